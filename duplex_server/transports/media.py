"""What the media transports (Twilio Media Streams, WebRTC) share: a link to the session
whose audio leaves as media rather than as JSON.

A media transport holds one :class:`MediaLink` and implements :class:`MediaOut` (how audio,
events and the hang-up reach its wire). The link holds the transport's writer (the one every
transport holds, :class:`~duplex_server.session.writer.QueuedWriter`: a bounded outbox, one
writer task, the hub's send watchdog, the same slow-client policy; the writer is what the
session sees) and its input path (:class:`~duplex_server.transports.media_input.InputFeed`).
The writer task runs on a :class:`MediaWire`: audio deltas go to the transport's media
(``write_audio``, never stamped: they are not events on the wire) with the PCM the session
runtime encoded them from (nothing is decoded here), every other event is stamped and
journaled as usual and handed to ``write_event``.

The playout seam (:mod:`duplex_server.protocol.playout`): the session core keeps the playout
state; the transport only reports to it, through its link: audio handed to the far end
(:meth:`MediaLink.audio_queued`: ``Queued``), what the far end played and still holds
(:meth:`MediaLink.audio_played`: ``Played``) and a flush (``Flushed``); it says once, when
it opens the session, that it plays the audio at a far end (``FarEnd``: the server owns
playout, so an interruption is confirmed before it is final, ``interrupt_mode: auto``).
Barge-in is decided by the session core only, by its one rule
(:mod:`duplex_server.protocol.interruption`): on a response in progress, and on reply audio
the far end still plays after its response ended; the link carries out the
``output_audio_buffer.cleared`` (a stop) or ``.paused`` (a suspected interruption) that
results (:meth:`MediaWire.barge_in`: the transport flushes its playout and reports it). After
a stop the core truncates the item to what the caller heard; after a pause it holds the
item's audio, and a resume sends it again from the last played position as ordinary audio.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import msgspec

from duplex_server.protocol import events as ev
from duplex_server.protocol.errors import CloseCode, ProtocolError
from duplex_server.protocol.playout import FarEnd, Flushed, Played, PlayoutReport, Queued
from duplex_server.protocol.session_config import EffectiveSession, apply_patch
from duplex_server.session import handshake
from duplex_server.session.attach import Outgoing
from duplex_server.session.hub import Hub
from duplex_server.session.live import LiveSession
from duplex_server.session.writer import QueuedWriter
from duplex_server.transports.media_input import InputFeed

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


class MediaOut(Protocol):
    """How a media transport writes to its wire (its :class:`MediaLink` calls these)."""

    async def write_audio(self, event: ev.AudioDelta, pcm: bytes, rate: int) -> None:
        """Reply audio: ``event``'s chunk as PCM16 at ``rate``; say so to the link
        (:meth:`MediaLink.audio_queued`) if any of it will play."""
        ...

    async def write_event(self, event: ev.ServerEvent, data: bytes) -> None:
        """Any other server event, stamped (``data``)."""
        ...

    async def write_raw(self, data: bytes) -> None:
        """Bytes stamped elsewhere (an error before the session existed)."""
        ...

    async def hang_up(self, code: int, reason: str) -> None: ...

    async def flush_playout(self) -> None:
        """Drop the audio the far end has not played yet (barge-in)."""
        ...

    def audio_done(self, response_id: str) -> None:
        """All of ``response_id``'s audio has been handed to ``write_audio``."""
        ...


class MediaLink:
    """One media transport's link to its live session: writer, input path, and the
    transport's playout reports to the session core."""

    def __init__(self, hub: Hub, kind: str) -> None:
        self.hub = hub
        self.kind = kind  # metrics and log label
        # media transports are never resumed onto: replaced, they close without a word
        self.writer = QueuedWriter(hub, announce_replaced=False)
        self.feed: InputFeed | None = None

    @property
    def session(self) -> LiveSession | None:
        return self.writer.session

    def register(self) -> None:
        handshake.connected(self.hub, self.writer)

    def unregister(self) -> None:
        handshake.disconnected(self.hub, self.writer)
        if self.session is not None:
            self.session.detach(self.writer)

    async def open_session(self, patch: dict[str, Any]) -> LiveSession:
        """Open a session for this transport and apply ``patch`` (a session.update)."""
        session = await handshake.open_session(self.hub, self.writer, patch=patch)
        self.writer.session = session
        self.feed = InputFeed(session)
        self.report(FarEnd())  # the server plays this session's audio and reports it
        handshake.outcome(self.hub, f"{self.kind}_opened")
        return session

    def end_session(self, reason: str = "client") -> None:
        """The far end hung up: the session ends (media transports do not resume)."""
        session = self.session
        if session is not None and not session.core.closed:
            session.apply(session.core.close(reason))
        else:
            self.writer.close(CloseCode.NORMAL, reason)

    # ------------------------------------------------------------------ playout reports
    def report(self, report: PlayoutReport) -> None:
        """Tell the session core how the far end's playout stands."""
        session = self.session
        if session is not None:
            session.report_playout(report)

    def audio_queued(self, item_id: str) -> None:
        """The far end was handed audio of ``item_id`` to play (it reports it played)."""
        self.report(Queued(item_id))

    def audio_played(self, item_id: str, ms: float, queued_ms: float) -> None:
        """The far end played ``item_id`` through ``ms`` (as heard) and holds ``queued_ms``
        more it has not played."""
        self.report(Played(item_id, ms, queued_ms))

    async def run_writer(self, out: MediaOut) -> None:
        """The transport's writer task, writing to ``out`` (held by the task alone: the
        transport that holds this link makes no reference cycle with it)."""
        await self.writer.run(MediaWire(self, out))


class MediaWire:
    """The writer's :class:`~duplex_server.session.writer.Wire` for a media transport: routes
    each event to the transport's :class:`MediaOut` and carries out barge-in on its media."""

    def __init__(self, link: MediaLink, out: MediaOut) -> None:
        self.link = link
        self.out = out

    async def deliver(self, item: Outgoing, session: LiveSession | None) -> bool:
        """Audio deltas go to the media (never stamped), other events are stamped and
        handed to ``write_event``; bytes stamped elsewhere go to ``write_raw``."""
        if session is None or item.event is None:
            if item.raw is not None:
                await self.out.write_raw(item.raw)
            return False
        event = item.event
        if isinstance(event, ev.AudioDelta):
            if item.epoch is not None and item.epoch < session.core.epoch:
                session.metrics.stale_dropped.labels("writer").inc()
                return False
            rate = session.core.config.output_format.rate
            await self.out.write_audio(event, item.pcm, rate)
            return True
        data = session.next_frame(item)
        if data is None:
            return False
        await self.out.write_event(event, data)
        if isinstance(event, ev.OutputAudioCleared | ev.OutputAudioPaused):
            await self.barge_in()  # the core's decision: a stop, or a pause
        elif isinstance(event, ev.AudioDone):
            self.out.audio_done(event.response_id)
        return True

    async def barge_in(self) -> None:
        """Flush what the far end has not played and say so; the session core truncates
        the item to what was heard (a stop) or keeps it to resume from there (a pause)."""
        link = self.link
        await self.out.flush_playout()
        if link.feed is not None:
            link.feed.flush_echo()
        link.report(Flushed())

    async def finish(self, code: int, reason: str) -> None:
        await self.out.hang_up(code, reason)

    async def stalled(self) -> None:
        code, reason = self.link.writer.closing or (CloseCode.POLICY, "client_too_slow")
        await self.out.hang_up(code, reason)

    def writer_done(self) -> None:
        """Nothing more to do: the transport ends with its own tasks."""
