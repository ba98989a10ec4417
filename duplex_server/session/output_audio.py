"""Output audio encoding: engine PCM16 -> the session's output format (soxr + G.711 tables).

The session runtime encodes each piece of reply audio once (``SendAudio`` from the protocol
core): the encoded bytes become the WebSocket's ``response.output_audio.delta`` (base64),
and the PCM16 at the output rate is what a media transport plays.
"""

from __future__ import annotations

from audio_kit.g711 import pcm16_to_g711
from audio_kit.pcm import StreamResampler
from duplex_server.protocol import events as ev
from duplex_server.protocol.codec import AudioFormat, encode_audio_b64
from duplex_server.protocol.commands import SendAudio


class OutputEncoder:
    """One per session; keeps a streaming resampler per (input rate, output rate)."""

    def __init__(self) -> None:
        self._resamplers: dict[tuple[int, int], StreamResampler] = {}

    def encode(
        self, pcm: bytes, rate: int, fmt: AudioFormat, *, restart: bool = False
    ) -> tuple[bytes, bytes]:
        """(PCM16 at ``fmt.rate``, the same audio in ``fmt``'s codec); ``restart``: the audio
        starts again (a resume), so the resampler's held-back tail of what came before,
        which the far end dropped, is dropped too."""
        if rate != fmt.rate:
            key = (rate, fmt.rate)
            resampler = self._resamplers.get(key)
            if resampler is None or restart:
                resampler = self._resamplers[key] = StreamResampler(rate, fmt.rate)
            pcm = resampler.process(pcm)
        if fmt.codec == "pcm16":
            return pcm, pcm
        return pcm, pcm16_to_g711(pcm, fmt.codec)

    def delta(self, audio: SendAudio, fmt: AudioFormat) -> tuple[ev.AudioDelta, bytes]:
        """The core's reply audio as the audio delta event it becomes (in ``fmt``, base64)
        and, beside it, the same audio as PCM16 at ``fmt.rate``."""
        pcm, data = self.encode(audio.pcm, audio.sample_rate, fmt, restart=audio.restart)
        delta = ev.AudioDelta(
            response_id=audio.response_id,
            item_id=audio.item_id,
            delta=encode_audio_b64(data),
            epoch=audio.epoch,
            audio_start_ms=audio.audio_start_ms,
            duration_ms=audio.duration_ms,
        )
        return delta, pcm
