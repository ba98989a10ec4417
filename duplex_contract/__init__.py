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
* :mod:`~duplex_contract.events`: the session events the engine emits.
"""
