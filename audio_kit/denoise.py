"""Input noise reduction: the WebRTC audio processing module's noise suppressor
(``webrtc-noise-gain`` from PyPI, the same C++ code as browsers' ``noiseSuppression``), on
PCM16 mono 16 kHz in 10 ms frames.

``near_field`` (a headset or phone held close): suppression level 2 (of 0-4).
``far_field`` (a laptop or room microphone, more noise relative to the voice): level 4. The
module's automatic gain control stays off: measured with bench/noise_reduction.py, raising
the gain of noisy far-field input brought VAD false triggers back. The module does noise
suppression and gain only: no echo cancellation.

:class:`NoiseSuppressor` is streaming: it holds back less than one 10 ms frame until the
next call, so its output lags its input by at most 10 ms.
"""

from __future__ import annotations

from typing import Any, Literal

NoiseReduction = Literal["near_field", "far_field"]

_FRAME = 320  # bytes: 10 ms of PCM16 at 16 kHz
#: (auto gain target dBFS (0 = off), noise suppression level) per type
_LEVELS: dict[str, tuple[int, int]] = {"near_field": (0, 2), "far_field": (0, 4)}


class NoiseSuppressor:
    """Streaming noise suppression of PCM16 mono 16 kHz (one per session input)."""

    def __init__(self, kind: NoiseReduction) -> None:
        from webrtc_noise_gain import AudioProcessor

        gain, level = _LEVELS[kind]
        self.kind = kind
        self._proc: Any = AudioProcessor(gain, level)
        self._held = b""

    def process(self, pcm: bytes) -> bytes:
        """Suppress noise in ``pcm``; returns whole 10 ms frames (the rest waits)."""
        data = self._held + pcm
        cut = len(data) - len(data) % _FRAME
        self._held = data[cut:]
        out = [self._proc.Process10ms(data[i : i + _FRAME]).audio for i in range(0, cut, _FRAME)]
        return b"".join(out)
