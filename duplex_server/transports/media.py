"""What the media transports (Twilio Media Streams, WebRTC) share: an attachment whose
audio leaves as media rather than as JSON, and the input path into the session.

:class:`MediaAttachment` implements the session's :class:`~duplex_server.session.attach.Attachment`
and the hub's transport interface with the writer every transport uses
(:class:`~duplex_server.session.writer.QueuedWriter`: a bounded outbox, one writer task, the hub's
send watchdog, the same slow-client policy); its delivery routes each event: audio deltas
go to the transport's media (``write_audio``, never stamped: they are not events on the
wire), every other event is stamped and journaled as usual and handed to ``write_event``.
Audio deltas arrive with their PCM (the session runtime encodes reply audio once), so
nothing is decoded here. The attachment reports its far end's playout to the session core
(:mod:`duplex_server.protocol.playout`): audio handed to the far end (``Queued``), what it
played (``Played``, :meth:`MediaAttachment.audio_played`) and a flush (``Flushed``).
Barge-in is decided by the session core only, by its guards
(:mod:`duplex_server.protocol.input`): on a response in progress, and on reply audio the
far end still plays after its response ended; the transport carries out the
``output_audio_buffer.cleared`` that results, and the core truncates the item to what
the caller heard.

:class:`InputFeed` takes the transport's decoded PCM16, runs echo control
(:mod:`audio_kit.echo`) when the session asks for it, and hands the session its audio
in the session's input format.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec
import numpy as np
import soxr

from audio_kit.echo import RATE as ECHO_RATE
from audio_kit.echo import EchoControl
from audio_kit.g711 import pcm16_to_g711
from audio_kit.pcm import StreamResampler
from duplex_server.protocol import events as ev
from duplex_server.protocol.config import EffectiveSession, apply_patch
from duplex_server.protocol.errors import CloseCode, ProtocolError
from duplex_server.protocol.playout import Flushed, Played, PlayoutReport, Queued
from duplex_server.session import handshake
from duplex_server.session.attach import Outgoing
from duplex_server.session.hub import Hub
from duplex_server.session.live import LiveSession, now_ms
from duplex_server.session.writer import QueuedWriter

log = logging.getLogger(__name__)


def check_session_patch(patch: Any) -> None:
    """Validate a session object given at call set-up; raises :class:`ProtocolError`."""
    try:
        param = msgspec.convert(patch, ev.SessionParam)
    except msgspec.ValidationError as exc:
        raise ProtocolError("invalid_value", f"session: {exc}", param="session") from None
    apply_patch(EffectiveSession(), param)


def merge_patch(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_patch(out[key], value)
        else:
            out[key] = value
    return out


class MediaAttachment(QueuedWriter):
    """Base of the media transports; subclasses write audio, events and the hang-up."""

    #: metrics and log label
    kind = "media"

    def __init__(self, hub: Hub) -> None:
        super().__init__(hub)
        self.feed: InputFeed | None = None
        self.audio_item: str | None = None  # the item whose audio is playing or queued
        self.ended = asyncio.Event()

    # ------------------------------------------------------------------ Attachment
    def replaced(self, data: bytes) -> None:  # media transports are never resumed onto
        self.session = None
        self.outbox.drain()
        self.close(CloseCode.NORMAL, "replaced")

    # ------------------------------------------------------------------ to implement
    async def write_audio(self, event: ev.AudioDelta, pcm: bytes, rate: int) -> None:
        """Hand ``pcm`` (PCM16 at ``rate``) to the far end, and say so if any of it will
        play (:meth:`audio_queued`)."""
        raise NotImplementedError

    async def write_event(self, event: ev.ServerEvent, data: bytes) -> None:
        raise NotImplementedError

    async def write_raw(self, data: bytes) -> None:
        """Bytes stamped elsewhere (an error before the session existed)."""
        raise NotImplementedError

    async def hang_up(self, code: int, reason: str) -> None:
        raise NotImplementedError

    async def flush_playout(self) -> None:
        """Drop the audio the far end has not played yet (barge-in)."""
        raise NotImplementedError

    def audio_done(self, response_id: str) -> None:
        """All of ``response_id``'s audio has been handed to ``write_audio``."""

    # ------------------------------------------------------------------ session
    def register(self) -> None:
        handshake.connected(self.hub, self)

    def unregister(self) -> None:
        handshake.disconnected(self.hub, self)
        if self.session is not None:
            self.session.detach(self)

    async def open_session(self, patch: dict[str, Any]) -> LiveSession:
        """Open a session for this transport and apply ``patch`` (a session.update)."""
        session = await handshake.open_session(self.hub, self, patch=patch)
        self.session = session
        self.feed = InputFeed(session)
        handshake.outcome(self.hub, f"{self.kind}_opened")
        return session

    def end_session(self, reason: str = "client") -> None:
        """The far end hung up: the session ends (media transports do not resume)."""
        session = self.session
        if session is not None and not session.core.closed:
            session.apply(session.core.close(reason))
        else:
            self.close(CloseCode.NORMAL, reason)

    def report(self, report: PlayoutReport) -> None:
        """Tell the session core how the far end's playout stands."""
        session = self.session
        if session is not None:
            session.apply(session.core.on_playout(report, now_ms()))

    def audio_queued(self, item_id: str) -> None:
        """The far end was handed audio of ``item_id`` to play (it reports it played)."""
        self.report(Queued(item_id))

    def audio_played(self, item_id: str, ms: float, queued_ms: float) -> None:
        """The far end played ``item_id`` through ``ms`` and holds ``queued_ms`` more."""
        self.report(Played(item_id, ms, queued_ms))

    async def barge_in(self) -> None:
        """Flush what the far end has not played; the session core truncates the item
        to what it heard."""
        await self.flush_playout()
        if self.feed is not None and self.feed.echo is not None:
            self.feed.echo.flush()
        self.audio_item = None
        self.report(Flushed())

    # ------------------------------------------------------------------ QueuedWriter
    async def deliver(self, item: Outgoing, session: LiveSession | None) -> bool:
        """Audio deltas go to the media (never stamped), other events are stamped and
        handed to ``write_event``; bytes stamped elsewhere go to ``write_raw``."""
        if session is None or item.event is None:
            if item.raw is not None:
                await self.write_raw(item.raw)
            return False
        event = item.event
        if isinstance(event, ev.AudioDelta):
            if item.epoch is not None and item.epoch < session.core.epoch:
                session.metrics.stale_dropped.labels("writer").inc()
                return False
            self.audio_item = event.item_id
            await self.write_audio(event, item.pcm, session.core.config.output_format.rate)
            return True
        data = session.next_frame(item)
        if data is None:
            return False
        await self.write_event(event, data)
        await self._observe(event)
        return True

    async def finish(self, code: int, reason: str) -> None:
        await self.hang_up(code, reason)

    async def stalled(self) -> None:
        code, reason = self.closing or (CloseCode.POLICY, "client_too_slow")
        await self.hang_up(code, reason)

    def writer_done(self) -> None:
        self.ended.set()

    async def _observe(self, event: ev.ServerEvent) -> None:
        """Barge-in decisions (the session core's) the transport carries out on its media."""
        if isinstance(event, ev.OutputAudioCleared):
            await self.barge_in()
        elif isinstance(event, ev.AudioDone):
            self.audio_done(event.response_id)


class InputFeed:
    """Transport PCM16 -> (echo control at 16 kHz) -> the session's input format."""

    def __init__(self, session: LiveSession) -> None:
        self.session = session
        self.echo: EchoControl | None = None
        self._to16k: dict[int, StreamResampler] = {}
        self._last8k = 0  # the previous 8 kHz sample (the 2x interpolation's one of state)
        self._out: StreamResampler | None = None

    def _echo_on(self) -> bool:
        on = self.session.core.config.echo_cancellation
        if on and self.echo is None:
            self.echo = EchoControl()
        elif not on:
            self.echo = None
        return on

    def _upsample2x(self, pcm: bytes) -> bytes:
        """8 -> 16 kHz by linear interpolation: no delay, one sample out per half sample in.

        A stream resampler delays and batches its output, so the input would reach the echo
        canceller in irregular blocks while the transport's playout reports (Twilio marks)
        assume it arrives as it was recorded; telephone audio has nothing above 4 kHz to
        lose to the simpler filter."""
        x = np.frombuffer(pcm[: len(pcm) - len(pcm) % 2], dtype="<i2").astype(np.int32)
        if not x.size:
            return b""
        prev = np.concatenate(([self._last8k], x[:-1]))
        out = np.empty(x.size * 2, dtype=np.int32)
        out[0::2] = (prev + x) // 2
        out[1::2] = x
        self._last8k = int(x[-1])
        return out.astype("<i2").tobytes()

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
                self._out = StreamResampler(ECHO_RATE, fmt.rate)
            pcm16k = self._out.process(pcm16k)
        data = pcm16k if fmt.codec == "pcm16" else pcm16_to_g711(pcm16k, fmt.codec)
        self.session.receive_audio(data)

    def _resample(self, pcm: bytes, rate: int) -> bytes:
        if rate == ECHO_RATE:
            return pcm
        if rate * 2 == ECHO_RATE:
            return self._upsample2x(pcm)
        res = self._to16k.get(rate)
        if res is None:
            res = self._to16k[rate] = StreamResampler(rate, ECHO_RATE)
        return res.process(pcm)
