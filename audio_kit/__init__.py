"""The audio kit: the audio tools both the session server and the engine use.

* :mod:`~audio_kit.pcm`: PCM16 <-> float32, soxr resampling (one-shot and streaming),
  framing (:class:`~audio_kit.pcm.PcmChunker`), edge trimming and the quiet-tail rule;
* :mod:`~audio_kit.g711`: G.711 μ-law / A-law <-> PCM16 (libsndfile's tables);
* :mod:`~audio_kit.vad`: voice activity detection (Silero on onnxruntime, an energy VAD)
  and the segmenter that turns probabilities into speech started / stopped;
* :mod:`~audio_kit.smart_turn`: semantic end of turn (Smart Turn v3.2 on onnxruntime);
* :mod:`~audio_kit.denoise`: input noise suppression (the WebRTC APM's);
* :mod:`~audio_kit.echo`: echo control for media transports (the WebRTC APM's canceller
  and a barge-in guard).

The rule (``tools/import_boundary.py`` checks it in ``make lint``): the kit is a leaf. It
imports neither ``engine`` nor ``duplex_server`` (nor the SDK); of the first-party
packages it may import only itself and :mod:`duplex_contract`, the lowest layer, for the
engine's audio constants and its typed errors (``ConfigError`` for a missing model file).
Importing this package loads none of its modules: import the one you need.
"""
