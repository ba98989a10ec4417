"""Output audio encoding: engine PCM16 -> the session's output format (soxr + G.711 tables)."""

from __future__ import annotations

from audio_kit.g711 import pcm16_to_g711
from audio_kit.pcm import StreamResampler
from duplex_server.protocol.codec import AudioFormat


class OutputEncoder:
    """One per session; keeps a streaming resampler per (input rate, output rate)."""

    def __init__(self) -> None:
        self._resamplers: dict[tuple[int, int], StreamResampler] = {}

    def encode(self, pcm: bytes, rate: int, fmt: AudioFormat) -> bytes:
        if rate != fmt.rate:
            key = (rate, fmt.rate)
            resampler = self._resamplers.get(key)
            if resampler is None:
                resampler = self._resamplers[key] = StreamResampler(rate, fmt.rate)
            pcm = resampler.process(pcm)
        if fmt.codec == "pcm16":
            return pcm
        return pcm16_to_g711(pcm, fmt.codec)
