"""The WebSocket transport: socket frames <-> a live session. No protocol decisions here.

One :class:`SocketAttachment` per socket implements the session's
:class:`~duplex_server.attach.Attachment` interface and runs one TaskGroup with two tasks:
``reader`` (frames -> session) and ``writer`` (outbound queue -> socket; the session stamps
and journals each event as it is written). Opening, resuming and taking a session over are
decided by the session core (:mod:`duplex_server.session_runtime`).

Slow-client policy: each socket has a bounded outbound queue (``output_buffer_bytes``) and
a per-frame send timeout (``send_timeout_s``). A client that overflows the queue or stalls a
send loses its session (the hub's watchdog checks every writer's send in progress, so no
timer is armed per frame): the session core drops the queue, sends ``error{code: client_too_slow}``
and ``session.closed`` best-effort, closes the engine session, and the socket closes with
1008. Server memory never grows without bound because of one client.
"""

from __future__ import annotations

import asyncio
import logging

from starlette.websockets import WebSocket, WebSocketDisconnect

from duplex_contract.errors import EngineError
from duplex_server.attach import Outbox, Outgoing
from duplex_server.auth import admit
from duplex_server.hub import Hub
from duplex_server.protocol import events as ev
from duplex_server.protocol.codec import decode_client_event, encode_server_event
from duplex_server.protocol.errors import CloseCode, ProtocolError, SessionFatal, to_wire_error
from duplex_server.session_runtime import LiveSession

log = logging.getLogger(__name__)


class SocketAttachment:
    """One WebSocket; attached to at most one live session at a time."""

    def __init__(self, hub: Hub, ws: WebSocket) -> None:
        self.hub, self.ws = hub, ws
        self.outbox = Outbox(hub.config.server.output_buffer_bytes)
        self.session: LiveSession | None = None
        self._close: tuple[int, str] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._writer_task: asyncio.Task[None] | None = None
        self._stalled = False
        #: loop time when the frame being written started (None: not in a send)
        self.send_since: float | None = None
        #: the close code the client sent (1006: the connection dropped without one)
        self.peer_close_code: int | None = None

    # ------------------------------------------------------------------ Attachment
    def send_event(self, item: Outgoing) -> bool:
        # a socket already closing drops what does not fit; it is not a slow client
        return self.outbox.put(item) or self._close is not None

    def send_stamped(self, data: bytes) -> None:
        self.outbox.put_raw(data)

    def purge_audio(self, below_epoch: int) -> int:
        return self.outbox.purge_audio(below_epoch)

    def take_unsent(self) -> list[Outgoing]:
        return self.outbox.drain()

    def close(self, code: int, reason: str) -> None:
        if self._close is None:
            self._close = (code, reason)
        self.outbox.wake.set()

    def replaced(self, data: bytes) -> None:
        self.session = None  # later frames of this socket are refused silently
        self.outbox.drain()
        self.outbox.put_raw(data)
        self.close(CloseCode.NORMAL, "replaced")

    @property
    def queued_bytes(self) -> int:
        return self.outbox.nbytes

    # ------------------------------------------------------------------ slow client
    def send_stalled(self) -> None:
        """The watchdog saw a send outlast ``send_timeout_s``: stop the writer (too slow)."""
        task = self._writer_task
        if task is not None and not task.done() and not self._stalled:
            self._stalled = True
            task.cancel()

    def fatal(self, exc: ProtocolError) -> None:
        """An error before (or without) a session: sent, then the socket closes."""
        if self.session is not None:
            self.session.fail(exc)
            return
        detail, code = to_wire_error(exc)
        data, _ = encode_server_event(ev.Error(error=detail), event_id="event_error", seq=0)
        self.outbox.put_raw(data)
        self.close(code or CloseCode.POLICY, detail.code)

    # ------------------------------------------------------------------ tasks
    def _stop(self) -> None:
        for task in self._tasks:
            task.cancel()

    async def serve(self) -> None:
        self.hub.ensure_watchdog()
        try:
            async with asyncio.TaskGroup() as tg:
                self._writer_task = tg.create_task(self._writer(), name="writer")
                self._tasks = [tg.create_task(self._reader(), name="reader"), self._writer_task]
        finally:
            # a cancelled task keeps its CancelledError, whose traceback holds the task's
            # frames and so this socket: without this, socket -> task -> error -> frame ->
            # socket is a cycle, and the socket's session (journal, outbox) waited for the
            # cyclic GC instead of being freed when the socket ends
            self._tasks, self._writer_task = [], None

    async def _reader(self) -> None:
        try:
            await self._read_loop()
        except WebSocketDisconnect as exc:
            self.peer_close_code = exc.code
        finally:
            if self._close is None:  # the client went away: stop everything now
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
            if size > max_frame:
                too_large = f"frame of {size} bytes is over {max_frame}"
                self.fatal(SessionFatal("frame_too_large", too_large))
                return
            session = self.session
            if session is None:
                continue  # replaced or closed: later input is refused silently
            if text is not None:
                session.receive_text(text)
            elif data:
                session.receive_audio_frame(data)

    async def _writer(self) -> None:
        try:
            await self._write_loop()
        except WebSocketDisconnect:
            pass  # the client went away mid-send: nothing more to write (it can resume)
        except asyncio.CancelledError:
            if not self._stalled:
                raise  # (before any local for the task: the error keeps this frame)
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()  # cancelled by the send watchdog: the client reads too slowly
            if self.session is not None:
                self.session.too_slow()
        finally:
            self._stop()

    async def _write_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            item = self.outbox.pop()
            if item is None:
                if self._close is not None:
                    break
                await self.outbox.wake.wait()
                continue
            session = self.session
            data = item.raw if session is None else session.next_frame(item)
            if data is None:
                continue  # stale audio, or an event for a session no longer attached
            self.send_since = loop.time()  # the watchdog enforces send_timeout_s
            try:
                await self.ws.send_text(data.decode())
            finally:
                self.send_since = None
            if session is not None and item.event is not None:
                session.sent(item)
        code, reason = self._close or (CloseCode.NORMAL, "")
        await self.ws.close(code, reason)


async def realtime_endpoint(ws: WebSocket) -> None:
    hub: Hub = ws.app.state.hub
    s = hub.config.server
    offered = ws.scope.get("subprotocols", [])
    adm = admit(ws.headers, offered, keys=hub.keys, allowed_origins=s.allowed_origins)
    await ws.accept(subprotocol=adm.subprotocol)
    sock = SocketAttachment(hub, ws)
    hub.sockets.add(sock)
    hub.metrics.connections.labels("open").inc()
    try:
        outcome = await _handshake(hub, sock, adm.ok, adm.code, adm.message)
        hub.metrics.connection_outcomes.labels(outcome).inc()
        if outcome != "disconnected":
            await sock.serve()
    finally:
        hub.sockets.discard(sock)
        if not hub.sockets:
            hub.no_connections.set()
        hub.metrics.connections.labels("open").dec()
        if sock.session is not None:
            if sock.peer_close_code == CloseCode.NORMAL:
                sock.session.peer_closed(sock)  # a clean close ends the session (§6)
            else:
                sock.session.detach(sock)  # a drop: kept for the grace period
        try:
            await ws.close(CloseCode.NORMAL)
        except Exception:  # already closed by the peer or by the writer: nothing to do
            log.debug("socket already closed", exc_info=True)


async def _handshake(hub: Hub, sock: SocketAttachment, ok: bool, code: str, msg: str) -> str:
    """Admit, then open a new session or resume one. Returns the outcome label."""
    ws = sock.ws
    try:
        if not ok:
            raise SessionFatal(code, msg)
        engine = hub.sessions.engine
        if hub.draining:
            raise SessionFatal(
                "server_draining",
                "this front end is draining; resume or open elsewhere",
                close_code=CloseCode.TRY_AGAIN,
                error_type="server_error",
            )
        if hub.closing or engine is None or not engine.ready:
            raise SessionFatal(
                "engine_unavailable", "the engine is not ready", close_code=CloseCode.TRY_AGAIN
            )
        if ws.query_params.get("intent") != "resume":
            beta = "realtime=v1" in ws.headers.get("openai-beta", "")
            beta = beta or ws.query_params.get("event_names") == "beta"
            sock.session = await hub.sessions.open(sock, hub.capabilities(), beta=beta)
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
        sock.session = await hub.sessions.resume(sock, event)
        return "resumed"
    except WebSocketDisconnect:
        return "disconnected"
    except TimeoutError:
        sock.fatal(SessionFatal("resume_timeout", "no session.resume in time"))
        return "resume_timeout"
    except (ProtocolError, EngineError) as exc:
        detail, close = to_wire_error(exc)
        close = close or CloseCode.POLICY
        sock.fatal(
            SessionFatal(detail.code, detail.message, close_code=close, error_type=detail.type)
        )
        return detail.code
