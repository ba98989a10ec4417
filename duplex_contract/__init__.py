"""The contract between the session server and the engine.

Both sides import this package; it imports neither of them (``make lint`` checks it, see
``tools/import_boundary.py``). It holds exactly what crosses the boundary:

* :mod:`~duplex_contract.fence`: the session position every call and event carries;
* :mod:`~duplex_contract.errors`: the typed errors (and their stable codes) the engine
  raises and the protocol core maps to wire errors;
* :mod:`~duplex_contract.settings`: the one :class:`SessionSettings` struct (what a
  session.update can change in the engine) and its patch form;
* :mod:`~duplex_contract.audio`: the engine's input audio format (PCM16 mono 16 kHz) and
  the one duration helper;
* :mod:`~duplex_contract.session_events`: the session events the engine emits, and errors in
  transit;
* :mod:`~duplex_contract.control`: the control calls a front end makes on a session and
  their one result;
* :mod:`~duplex_contract.batch`: the batch jobs and the items they stream back;
* :mod:`~duplex_contract.tracecontext`: the W3C trace context written on the calls.
* :mod:`~duplex_contract.audible`: when audio becomes audible (-40 dBFS), the one
  definition the engine's TTS trim, the benches and the SDK's latency figures share.

Each name has this one home: the engine imports it from here and re-exports nothing.
"""
