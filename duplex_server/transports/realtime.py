"""The WebSocket transport: socket frames <-> a live session. No protocol decisions here.

One :class:`SocketTransport` per socket runs one TaskGroup with two tasks: ``reader`` (frames ->
session) and ``writer`` (the writer every transport holds,
:class:`~duplex_server.session.writer.QueuedWriter`: outbound queue -> socket; the session stamps
and journals each event as it is written). The writer is what the session sees of the socket
(its :class:`~duplex_server.session.attach.Attachment`); the socket is the
:class:`~duplex_server.session.writer.Wire` the writer runs on. Admission, opening and
resuming go through :mod:`duplex_server.session.handshake`; opening, resuming and taking a
session over are decided by the session core (:mod:`duplex_server.session.live`).

Slow-client policy (the writer's, the same on every transport): each socket has a bounded
outbound queue (``output_buffer_bytes``) and a per-frame send timeout (``send_timeout_s``).
A client that overflows the queue or stalls a send loses its session (the hub's watchdog
checks every writer's send in progress, so no timer is armed per frame): the session core
drops the queue, sends ``error{code: client_too_slow}`` and ``session.closed`` best-effort,
closes the engine session, and the socket closes with 1008. Server memory never grows
without bound because of one client.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect

from duplex_contract.errors import EngineError
from duplex_server.client_secrets import Use
from duplex_server.protocol import events as ev
from duplex_server.protocol.codec import decode_client_event, encode_server_event
from duplex_server.protocol.errors import CloseCode, ProtocolError, SessionFatal, to_wire_error
from duplex_server.session import handshake
from duplex_server.session.attach import Outgoing
from duplex_server.session.hub import Hub
from duplex_server.session.live import LiveSession
from duplex_server.session.writer import QueuedWriter
from duplex_server.transports.ws_protocol import SCOPE_KEY, BufferedReadsProtocol

log = logging.getLogger(__name__)


class SocketTransport:
    """One WebSocket; attached to at most one live session at a time (through its writer)."""

    def __init__(self, hub: Hub, ws: WebSocket) -> None:
        self.hub = hub
        self.ws = ws
        self.writer = QueuedWriter(hub)
        self._tasks: list[asyncio.Task[None]] = []
        #: the connection's protocol (duplex_server/transports/ws_protocol.py), when the
        #: server runs it: frames come to :meth:`_on_message` and go out by ``send_text_now``
        extensions = ws.scope.get("extensions") or {}  # (optional in ASGI)
        self._proto: BufferedReadsProtocol | None = extensions.get(SCOPE_KEY)
        self._max_frame = hub.config.server.max_frame_bytes
        self._reading = True  # False once a frame was too large: nothing more is read
        #: the close code the client sent (1006: the connection dropped without one)
        self.peer_close_code: int | None = None

    @property
    def session(self) -> LiveSession | None:
        """The session this socket serves (None: none yet, replaced or closed)."""
        return self.writer.session

    def fatal(self, exc: ProtocolError) -> None:
        """An error before (or without) a session: sent, then the socket closes."""
        if self.session is not None:
            self.session.fail(exc)
            return
        detail, code = to_wire_error(exc)
        data, _ = encode_server_event(ev.Error(error=detail), event_id="event_error", seq=0)
        self.writer.send_stamped(data)
        self.writer.close(code or CloseCode.POLICY, detail.code)

    # ------------------------------------------------------------------ tasks
    def _stop(self) -> None:
        for task in self._tasks:
            task.cancel()

    async def serve(self) -> None:
        self.hub.ensure_watchdog()
        try:
            async with asyncio.TaskGroup() as tg:
                writer = tg.create_task(self._writer(), name="writer")
                self._tasks = [tg.create_task(self._reader(), name="reader"), writer]
        finally:
            # a cancelled task keeps its CancelledError, whose traceback holds the task's
            # frames and so this socket: without this, socket -> task -> error -> frame ->
            # socket is a cycle, and the socket's session (journal, outbox) waited for the
            # cyclic GC instead of being freed when the socket ends
            self._tasks = []

    async def _reader(self) -> None:
        try:
            await self._read_loop()
        except WebSocketDisconnect as exc:
            self.peer_close_code = exc.code
        finally:
            if self.writer.closing is None:  # the client went away: stop everything now
                self._stop()

    async def _read_loop(self) -> None:
        proto = self._proto
        if proto is not None:  # frames come to _on_message as they are parsed
            proto.direct = self._on_message
        try:
            while self._reading:
                msg = await self.ws.receive()
                if msg["type"] == "websocket.disconnect":
                    self.peer_close_code = msg.get("code", 1006)
                    return
                self._on_message(msg.get("text"), msg.get("bytes"))
        finally:
            if proto is not None:
                proto.direct = None

    def _on_message(self, text: str | None, data: bytes | None) -> None:
        """One whole message from the client (text or binary), in order."""
        if not self._reading:
            return
        size = len(text) if text is not None else len(data or b"")
        if size > self._max_frame:
            self._reading = False
            too_large = f"frame of {size} bytes is over {self._max_frame}"
            self.fatal(SessionFatal("frame_too_large", too_large))
            return
        session = self.session
        if session is None:
            return  # replaced or closed: later input is refused silently
        if text is not None:
            session.receive_text(text)
        elif data:
            session.audio.receive_frame(data)

    async def _writer(self) -> None:
        try:
            await self.writer.run(self)
        except WebSocketDisconnect:
            pass  # the client went away mid-send: nothing more to write (it can resume)

    # ------------------------------------------------------------------ Wire
    async def deliver(self, item: Outgoing, session: LiveSession | None) -> bool:
        data = item.raw if session is None else session.next_frame(item)
        if data is None:
            return False  # stale audio, or an event for a session no longer attached
        proto = self._proto
        if proto is None or not proto.send_text_now(data):
            await self.ws.send_text(data.decode())
        return True

    async def finish(self, code: int, reason: str) -> None:
        await self.ws.close(code, reason)

    async def stalled(self) -> None:
        """The session was told it is too slow; its close follows as usual."""

    def writer_done(self) -> None:
        self._stop()


async def realtime_endpoint(ws: WebSocket) -> None:
    hub: Hub = ws.app.state.hub
    use: Use = "resume" if ws.query_params.get("intent") == "resume" else "open"
    adm = handshake.admit_socket(hub, ws.headers, ws.scope.get("subprotocols", []), use)
    await ws.accept(subprotocol=adm.subprotocol)
    sock = SocketTransport(hub, ws)
    handshake.connected(hub, sock.writer)
    try:
        outcome = await _handshake(hub, sock, adm.ok, adm.code, adm.message, adm.session)
        handshake.outcome(hub, outcome)
        if outcome != "disconnected":
            await sock.serve()
    finally:
        handshake.disconnected(hub, sock.writer)
        session = sock.session
        if session is not None:
            if sock.peer_close_code == CloseCode.NORMAL:
                session.peer_closed(sock.writer)  # a clean close ends the session (§6)
            else:
                session.detach(sock.writer)  # a drop: kept for the grace period
        try:
            await ws.close(CloseCode.NORMAL)
        except Exception:  # already closed by the peer or by the writer: nothing to do
            log.debug("socket already closed", exc_info=True)


async def _handshake(
    hub: Hub,
    sock: SocketTransport,
    ok: bool,
    code: str,
    msg: str,
    patch: dict[str, Any] | None = None,
) -> str:
    """Admitted, then open a new session or resume one (:mod:`duplex_server.session.handshake`).
    ``patch``: a client secret's session object, applied to a new session. Returns the
    outcome label."""
    ws = sock.ws
    try:
        if not ok:
            raise SessionFatal(code, msg)
        handshake.require_engine(hub)
        if ws.query_params.get("intent") != "resume":
            beta = "realtime=v1" in ws.headers.get("openai-beta", "")
            beta = beta or ws.query_params.get("event_names") == "beta"
            sock.writer.session = await handshake.open_session(
                hub, sock.writer, beta=beta, patch=patch
            )
            return "opened"
        first = await asyncio.wait_for(ws.receive(), hub.config.server.resume_wait_s)
        if first["type"] == "websocket.disconnect":
            raise WebSocketDisconnect(first.get("code", 1000))
        text = first.get("text")
        if text is None:
            raise SessionFatal(
                "invalid_state", "expected session.resume as a text frame", close_code=1008
            )
        event = decode_client_event(text)
        if not isinstance(event, ev.SessionResume):
            raise SessionFatal("invalid_state", "expected session.resume", close_code=1008)
        sock.writer.session = await handshake.resume_session(hub, sock.writer, event)
        return "resumed"
    except WebSocketDisconnect:
        return "disconnected"
    except TimeoutError:
        sock.fatal(SessionFatal("resume_timeout", "no session.resume in time"))
        return "resume_timeout"
    except (ProtocolError, EngineError) as exc:
        detail, close = handshake.refusal(exc)
        sock.fatal(
            SessionFatal(detail.code, detail.message, close_code=close, error_type=detail.type)
        )
        return detail.code
