"""A media transport's input path: the far end's PCM16 -> echo control -> the session.

:class:`InputFeed` takes the transport's decoded PCM16 at the transport's rate, brings it to
16 kHz, runs echo control (:mod:`audio_kit.echo`) when the session asks for it
(``audio.input.echo_cancellation``), and hands the session its audio in the session's input
format. What the transport plays reaches the echo canceller as its reference
(:meth:`InputFeed.reference`).
"""

from __future__ import annotations

import numpy as np
import soxr

from audio_kit.echo import RATE as ECHO_RATE
from audio_kit.echo import EchoControl
from audio_kit.g711 import pcm16_to_g711
from audio_kit.pcm import InputResampler, input_resampler
from duplex_server.session.live import LiveSession


class InputFeed:
    """Transport PCM16 -> (echo control at 16 kHz) -> the session's input format."""

    def __init__(self, session: LiveSession) -> None:
        self.session = session
        self.echo: EchoControl | None = None
        #: to 16 kHz with no delay (audio_kit.pcm.input_resampler: WebRTC's 48 kHz by a FIR
        #: filter, 8 kHz by interpolation): soxr's stream resampler delays and batches its
        #: output, so the input would reach the echo canceller in irregular blocks while the
        #: transport's playout reports (Twilio marks) assume it arrives as it was recorded,
        #: and the VAD heard each speech start ~22 ms late on average
        self._to16k: dict[int, InputResampler] = {}
        self._out: InputResampler | None = None

    def _echo_on(self) -> bool:
        on = self.session.core.config.echo_cancellation
        if on and self.echo is None:
            self.echo = EchoControl()
        elif not on:
            self.echo = None
        return on

    def flush_echo(self) -> None:
        """The far end's playout was flushed (barge-in): the echo path restarts."""
        if self.echo is not None:
            self.echo.flush()

    def played_through(self, position: int) -> None:
        """The far end reports it played the reference up to ``position``
        (a :meth:`reference` return value)."""
        if self.echo is not None:
            self.echo.played_through(position)

    def reference(self, pcm: bytes, rate: int) -> int:
        """What the transport plays (or queues to play); returns the playout position."""
        if self.echo is None and not self._echo_on():
            return 0
        assert self.echo is not None
        if rate != ECHO_RATE:  # each chunk whole: a stream resampler would hold back its tail
            samples = np.frombuffer(pcm, dtype="<i2")
            pcm = soxr.resample(samples, rate, ECHO_RATE).astype("<i2").tobytes()
        return self.echo.playing(pcm)

    def push(self, pcm: bytes, rate: int) -> None:
        """Microphone PCM16 at ``rate`` from the transport."""
        pcm16k = self._resample(pcm, rate)
        if self._echo_on():
            assert self.echo is not None
            pcm16k = self.echo.process(pcm16k)
        if not pcm16k:
            return
        fmt = self.session.core.config.input_format
        if fmt.rate != ECHO_RATE:
            if self._out is None or self._out.out_rate != fmt.rate:
                self._out = input_resampler(ECHO_RATE, fmt.rate)
            pcm16k = self._out.process(pcm16k)
        data = pcm16k if fmt.codec == "pcm16" else pcm16_to_g711(pcm16k, fmt.codec)
        self.session.audio.receive(data)

    def _resample(self, pcm: bytes, rate: int) -> bytes:
        if rate == ECHO_RATE:
            return pcm
        res = self._to16k.get(rate)
        if res is None:
            res = self._to16k[rate] = input_resampler(rate, ECHO_RATE)
        return res.process(pcm)
