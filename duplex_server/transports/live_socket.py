"""The GPT-Live WebSocket, ``/v1/live/sessions``: Live frames <-> a Live session on the
shared core. No protocol decisions here (docs/protocol.md, "GPT-Live").

One :class:`LiveSocket` per socket runs three tasks: the reader (Live client events to the
session's :class:`~duplex_server.session.live_runtime.LiveRuntime`), the writer (the writer
every transport holds, :class:`~duplex_server.session.writer.QueuedWriter`, on this socket
as its :class:`~duplex_server.session.writer.Wire`) and the pacer. The Live wire has no
client cancel or truncate, so this transport is the player: reply audio goes into an
:class:`~duplex_server.protocol.live_output.OutputPacer` and leaves at real time, at most
``server.live.output_lead_ms`` ahead, as ``session.output_audio.delta``; the transcript of
that audio leaves with it (:class:`~duplex_server.protocol.live_output.SpokenText`). It
reports to the session core what it was handed (``Queued``), what it sent and still holds
(``Played``: sent is heard) and, on the core's barge-in (``output_audio_buffer.cleared``),
that it dropped the rest (``Flushed``): the core cuts the history to what was sent.

Opening: the first frame must be ``session.start`` (anything else: an ``error``, close
1008); its config is checked once (:func:`~duplex_server.protocol.live_config.parse_start`).
A reconnect (the SDK's ``on_reconnecting`` hook sets the headers) carries
``X-Resume-Token: <session id>.<secret>`` (from ``session.started``) and optionally
``X-Last-Event-Id``: no ``session.start`` follows; the session goes on, and the Live events
after the last one the client names (else after the last one this server wrote) are sent
again, audio excepted. Admission is the WebSocket routes' (API key, Origin).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect

from audio_kit.g711 import pcm16_to_g711
from duplex_contract.errors import EngineError
from duplex_server.protocol import events as ev
from duplex_server.protocol.codec import encode_server_event
from duplex_server.protocol.errors import CloseCode, ProtocolError, SessionFatal, to_wire_error
from duplex_server.protocol.live_config import LiveOptions, parse_start
from duplex_server.protocol.live_events import (
    LiveError,
    LiveErrorObj,
    LiveMark,
    LiveOutputTranscript,
    LiveServerEvent,
    LiveSessionStart,
    audio_delta_frame,
    decode_live_event,
)
from duplex_server.protocol.live_output import OutputPacer, Slice, SpokenText, TextPiece
from duplex_server.protocol.playout import FarEnd, Flushed, Played, Queued
from duplex_server.session import handshake
from duplex_server.session.attach import Outgoing
from duplex_server.session.hub import Hub
from duplex_server.session.live import LiveSession, now_ms
from duplex_server.session.live_runtime import (
    ChatEngine,
    LiveRuntime,
    adopt_live,
    live_options,
    open_live,
)
from duplex_server.session.snapshot import Replica
from duplex_server.session.writer import QueuedWriter

log = logging.getLogger(__name__)

#: an item whose emitted audio is this much longer than what left was cut (smaller gaps
#: are the output resampler's held-back tail)
UNSENT_SLACK_MS = 30.0
RESUME_HEADER = "x-resume-token"
LAST_EVENT_HEADER = "x-last-event-id"
#: a session taken over from another front end with no ``X-Last-Event-Id``: what the other
#: one wrote after its replica is unknown, so the client is taken to have got it all and the
#: numbering goes on this far past the replica's (more than one front end's part sends)
ADOPT_SEQ_GAP = 100_000_000


def live_error_frame(exc: ProtocolError | EngineError) -> tuple[bytes, int]:
    """A Live ``error`` event before (or without) a session, and the close code after it."""
    detail, close = to_wire_error(exc)
    obj = LiveErrorObj(detail.type, detail.code, detail.message, detail.param, detail.event_id)
    event = LiveError(error=obj, client_event_id=detail.event_id)
    data, _ = encode_server_event(event, event_id="event_error", seq=0)
    return data, close or CloseCode.POLICY


def event_seq(event_id: str, session_id: str) -> int | None:
    """The seq of one of this session's event ids (``event_<tag><seq>``), else None."""
    prefix = f"event_{session_id[5:17]}"
    if not event_id.startswith(prefix) or not event_id[len(prefix) :].isdigit():
        return None
    return int(event_id[len(prefix) :])


class LiveSocket:
    """One Live WebSocket; attached to at most one Live session at a time."""

    def __init__(self, hub: Hub, ws: WebSocket, chat: ChatEngine | None) -> None:
        self.hub = hub
        self.ws = ws
        self.chat = chat
        self.options: LiveOptions = live_options(hub.config.server)
        self.writer = QueuedWriter(hub, announce_replaced=False)
        self.runtime: LiveRuntime | None = None
        self.pacer: OutputPacer | None = None
        self.spoken = SpokenText()
        self.peer_close_code: int | None = None
        self._wake = asyncio.Event()
        self._send_lock = asyncio.Lock()
        self._epochs: dict[str, int] = {}  # reply item -> the epoch of its audio
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def session(self) -> LiveSession | None:
        return self.writer.session

    # ------------------------------------------------------------------ handshake
    async def handshake(self, ok: bool, code: str, message: str) -> str:
        """Open or resume; returns the outcome label."""
        ws = self.ws
        try:
            if not ok:
                raise SessionFatal(code, message)
            handshake.require_engine(self.hub)
            token = ws.headers.get(RESUME_HEADER) or ws.query_params.get("resume_token")
            if token:
                await self._resume(token)
                return "live_resumed"
            await self._open()
            return "live_opened"
        except WebSocketDisconnect:
            return "disconnected"
        except TimeoutError:
            self.fatal(SessionFatal("session_start_timeout", "no session.start in time"))
            return "session_start_timeout"
        except (ProtocolError, EngineError) as exc:
            detail, _ = to_wire_error(exc)
            self.fatal(exc)
            return detail.code

    async def _open(self) -> None:
        server = self.hub.config.server
        first = await asyncio.wait_for(self.ws.receive(), server.resume_wait_s)
        if first["type"] == "websocket.disconnect":
            raise WebSocketDisconnect(first.get("code", 1000))
        text = first.get("text")
        if text is None:
            raise SessionFatal(
                "session_start_required", "the first event must be session.start (as JSON text)"
            )
        event = decode_live_event(text)
        if not isinstance(event, LiveSessionStart):
            raise SessionFatal(
                "session_start_required",
                f"the first event must be session.start, not {type(event).__struct_config__.tag}",
            )
        sessions = self.hub.sessions
        try:
            start = parse_start(
                event.session,
                options=self.options,
                default_instructions=sessions.instructions,
                served_model=sessions.model,
                voices=sessions.voices,
                websocket=True,
            )
        except ProtocolError as exc:  # the session cannot start: the error, then a close
            fatal = SessionFatal(exc.code, exc.message, close_code=CloseCode.POLICY)
            fatal.param = exc.param
            raise fatal from exc
        runtime = await open_live(self.hub, self.writer, start, self.options, self.chat)
        self._attach(runtime)
        if event.event_id:
            log.debug("%s: session.start %s", runtime.core.session_id, event.event_id)

    async def _resume(self, token: str) -> None:
        session_id, _, secret = token.partition(".")
        if not secret:
            raise SessionFatal("invalid_resume_token", "the resume token is <session id>.<secret>")
        session = self.hub.sessions.live.get(session_id)
        runtime = session.adapter if session is not None else None
        if session is not None and not isinstance(runtime, LiveRuntime):
            raise SessionFatal("session_not_found", f"no live Live session {session_id}")
        after = runtime.adapter.written_seq if isinstance(runtime, LiveRuntime) else ADOPT_SEQ_GAP
        last = self.ws.headers.get(LAST_EVENT_HEADER) or self.ws.query_params.get("last_event_id")
        if last:
            seq = event_seq(last, session_id)
            if seq is None:
                raise SessionFatal(
                    "invalid_value", "X-Last-Event-Id is not an event of this session"
                )
            after = seq
        req = ev.SessionResume(
            session_id=session_id, resume_token=secret, last_received_server_event_seq=after
        )
        adopted: list[LiveRuntime] = []

        def prepare(taken: LiveSession, rep: Replica) -> None:  # another front end's session
            adopted.append(adopt_live(taken, rep, self.options, self.chat))
            if not last:  # event ids must not repeat what the other front end sent
                taken.stamper.restart_at(rep.event_seq + ADOPT_SEQ_GAP)

        resumed = await handshake.resume_session(self.hub, self.writer, req, prepare=prepare)
        if adopted:
            runtime = adopted[0]
            runtime.start(self.hub)
        assert isinstance(runtime, LiveRuntime) and resumed is runtime.session
        self._attach(runtime)

    def _attach(self, runtime: LiveRuntime) -> None:
        self.runtime = runtime
        self.writer.session = runtime.session
        fmt = runtime.core.config.output_format
        self.pacer = OutputPacer(fmt.rate, lead_ms=self.options.output_lead_ms)
        # the pacer is the far end: it reports what it sent, and a pause's audio is held
        # in the core to be sent again from there (protocol/playout.py)
        runtime.session.report_playout(FarEnd())
        runtime.attached()

    def fatal(self, exc: ProtocolError | EngineError) -> None:
        """An error before (or without) a session: sent, then the socket closes."""
        data, code = live_error_frame(exc)
        self.writer.send_stamped(data)
        detail, _ = to_wire_error(exc)
        self.writer.close(code, detail.code)

    # ------------------------------------------------------------------ tasks
    def _stop(self) -> None:
        for task in self._tasks:
            task.cancel()

    async def serve(self) -> None:
        self.hub.ensure_watchdog()
        try:
            async with asyncio.TaskGroup() as tg:
                self._tasks = [
                    tg.create_task(self._reader(), name="live-reader"),
                    tg.create_task(self._writer(), name="live-writer"),
                    tg.create_task(self._pace(), name="live-pacer"),
                ]
        finally:
            self._tasks = []  # (no cycle through the tasks' errors: see realtime.py)

    async def serve_errors(self) -> None:
        """Only the writer: an error before a session, then the close."""
        with contextlib.suppress(WebSocketDisconnect):
            await self.writer.run(self)

    async def _reader(self) -> None:
        try:
            await self._read_loop()
        except WebSocketDisconnect as exc:
            self.peer_close_code = exc.code
        finally:
            if self.writer.closing is None:
                self._stop()

    async def _read_loop(self) -> None:
        max_frame = self.hub.config.server.max_frame_bytes
        while True:
            msg = await self.ws.receive()
            if msg["type"] == "websocket.disconnect":
                self.peer_close_code = msg.get("code", 1006)
                return
            text, data = msg.get("text"), msg.get("bytes")
            size = len(text) if text is not None else len(data or b"")
            session, runtime = self.session, self.runtime
            if session is None or runtime is None:
                continue  # replaced or closed: later input is refused silently
            if size > max_frame:
                too_large = f"frame of {size} bytes is over {max_frame}"
                session.fail(SessionFatal("frame_too_large", too_large))
                return
            if text is None:
                binary = "binary frames are not part of the Live protocol: send audio with "
                session.fail(ProtocolError("invalid_event", binary + "session.input_audio.append"))
                continue
            runtime.receive_text(text)

    async def _writer(self) -> None:
        with contextlib.suppress(WebSocketDisconnect):
            await self.writer.run(self)

    async def _send(self, text: str) -> None:
        async with self._send_lock:
            await self.ws.send_text(text)

    # ------------------------------------------------------------------ the pacer
    async def _pace(self) -> None:
        while True:
            pacer, session = self.pacer, self.session
            if pacer is None or session is None:
                return
            now = now_ms()
            pacer.purge(session.core.epoch)
            due = pacer.next_due(now)
            if due is None or due > now:
                self._wake.clear()
                timeout = None if due is None else (due - now) / 1000
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout)
                continue
            for piece in pacer.take(now, session.core.input.input_ms):
                await self._send_slice(session, piece)

    async def _send_slice(self, session: LiveSession, piece: Slice) -> None:
        fmt = session.core.config.output_format
        data = piece.pcm if fmt.codec == "pcm16" else pcm16_to_g711(piece.pcm, fmt.codec)
        await self._send(audio_delta_frame(base64.b64encode(data).decode("ascii")))
        session.report_playout(Played(piece.item_id, piece.item_end_ms, piece.queued_ms))
        await self._send_text(
            session, self.spoken.through(piece.item_id, piece.item_end_ms, piece.end_pos_ms)
        )

    async def _send_text(self, session: LiveSession, pieces: list[TextPiece]) -> None:
        for text in pieces:
            event = LiveOutputTranscript(
                delta=text.text, start_ms=text.start_ms, end_ms=text.end_ms
            )
            frame = session.next_frame(Outgoing(event, None, 256))
            if frame is not None:
                await self._send(frame.decode())
                self._written(session)

    def _written(self, session: LiveSession) -> None:
        if self.runtime is not None:
            self.runtime.adapter.written_seq = session.stamper.seq

    def _flush(self, session: LiveSession, *, pause: bool = False) -> None:
        """The core's barge-in: drop what was not sent, and say so (the core cuts the
        history to what was). Everything of the item not sent counts as held here (sent is
        heard): audio still in the pacer, purged before it reached it, or never made (a
        cancelled answer), unless the item ended and all it emitted left. A ``pause``
        (``interruption: confirm``) drops the same audio but keeps the item's words: a
        resume sends its audio again from the last slice sent, and its words with it."""
        if self.pacer is not None:
            self.pacer.flush()
        if not pause:
            self.spoken.flush()
        pos = session.core.playout.position()
        if pos is not None:
            cancelled = self._epochs.get(pos.item_id, session.core.epoch) < session.core.epoch
            unsent = pos.emitted_ms - pos.played_ms
            if cancelled or unsent > UNSENT_SLACK_MS:
                session.report_playout(Played(pos.item_id, pos.played_ms, max(unsent, 1.0)))
        session.report_playout(Flushed())

    # ------------------------------------------------------------------ Wire
    async def deliver(self, item: Outgoing, session: LiveSession | None) -> bool:
        event = item.event
        if event is None:  # pre-stamped bytes (an error before a session, a replay)
            if item.raw is not None:
                await self._send(item.raw.decode())
            return False
        if session is None:
            return False
        if isinstance(event, ev.AudioDelta):
            if self.pacer is None or (item.epoch is not None and item.epoch < session.core.epoch):
                return False
            self.pacer.push(
                item.epoch or 0, event.response_id, event.item_id, event.audio_start_ms, item.pcm
            )
            self.spoken.audio(
                event.item_id, event.audio_start_ms, len(item.pcm) * 500 / self.pacer.rate
            )
            self._epochs[event.item_id] = item.epoch or 0
            while len(self._epochs) > 8:
                del self._epochs[next(iter(self._epochs))]
            session.report_playout(Queued(event.item_id))
            self._wake.set()
            return True
        if isinstance(event, LiveMark):
            self.spoken.mark(event.item_id, event.start_ms, event.text)
            return False
        if isinstance(event, ev.AudioDone):
            # the words still held for the end, if the item's audio already left
            await self._send_text(session, self.spoken.ended(event.item_id))
            return False
        if isinstance(event, ev.OutputAudioCleared | ev.OutputAudioPaused):
            self._flush(session, pause=isinstance(event, ev.OutputAudioPaused))
            return False
        if not isinstance(event, LiveServerEvent):
            return False  # a Realtime event the adapter let through for the runtime only
        data = session.next_frame(item)
        if data is None:
            return False
        await self._send(data.decode())
        self._written(session)
        return True

    async def finish(self, code: int, reason: str) -> None:
        await self.ws.close(code, reason)

    async def stalled(self) -> None:
        """The session was told it is too slow; its close follows as usual."""

    def writer_done(self) -> None:
        self._stop()

    # ------------------------------------------------------------------ the end
    def ended(self) -> None:
        """The socket is gone: a normal close ends the session; a drop leaves it for a
        reconnect, its answer stopped where its audio stopped."""
        session, runtime = self.session, self.runtime
        if session is None or runtime is None:
            return
        if self.peer_close_code == CloseCode.NORMAL:
            session.peer_closed(self.writer)
            return
        if session.attachment is self.writer and not session.core.closed:
            self._flush(session)
            runtime.dropped()
        session.detach(self.writer)


async def live_endpoint(ws: WebSocket) -> None:
    hub: Hub = ws.app.state.hub
    chat: Any = ws.app.state.engine.get()
    adm = handshake.admit_socket(hub, ws.headers, ws.scope.get("subprotocols", []))
    await ws.accept(subprotocol=adm.subprotocol)
    sock = LiveSocket(hub, ws, chat)
    handshake.connected(hub, sock.writer)
    try:
        outcome = await sock.handshake(adm.ok, adm.code, adm.message)
        handshake.outcome(hub, outcome)
        if sock.runtime is not None:
            await sock.serve()
        elif outcome != "disconnected":
            await sock.serve_errors()
    finally:
        handshake.disconnected(hub, sock.writer)
        sock.ended()
        with contextlib.suppress(Exception):  # already closed by the peer or the writer
            await ws.close(CloseCode.NORMAL)
