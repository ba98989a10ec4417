"""The WebSocket adapter: socket <-> protocol core <-> engine. No protocol decisions here.

One :class:`Connection` per socket runs one TaskGroup with two named tasks: ``reader``
(frames -> core) and ``writer`` (outbound queue -> socket, stamping and journaling each
event). Its input lane (decode, resample, VAD in a worker thread) is run by the hub's
:class:`~duplex_server.turns.InputScheduler`, which batches the lanes of all sockets into
few executor jobs. The engine pump and the ordered call mailbox belong to the session
(:class:`~duplex_server.session_runtime.LiveSession`), which outlives its sockets.

Slow-client policy: each socket has a bounded outbound queue (``output_buffer_bytes``) and
a per-frame send timeout (``send_timeout_s``). A client that overflows the queue or stalls a
send loses its session (one hub watchdog checks every writer's send in progress, so no
timer is armed per frame): the queue is dropped, ``error{code: client_too_slow}`` and
``session.closed`` are sent best-effort, the engine session is closed, and the socket closes
with 1008. Server memory never grows without bound because of one client.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine
from concurrent.futures import Executor
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect

from duplex_server.attach import Journal, Outbox, token_matches
from duplex_server.auth import admit
from duplex_server.config import AppConfig
from duplex_server.metrics import Metrics
from duplex_server.output import OutputEncoder
from duplex_server.protocol import events as ev
from duplex_server.protocol.codec import (
    INPUT_FORMATS,
    OUTPUT_FORMATS,
    decode_client_event,
    encode_server_event,
)
from duplex_server.protocol.commands import Call, CloseSocket, Send
from duplex_server.protocol.config import EffectiveSession
from duplex_server.protocol.errors import CloseCode, ProtocolError, SessionFatal, to_wire_error
from duplex_server.protocol.session import SessionCore
from duplex_server.session_runtime import LiveSession, now_ms
from duplex_server.turns import InputLane, InputScheduler
from engine.client import AsyncEngine
from engine.errors import EngineError
from engine.messages import SessionConfig

log = logging.getLogger(__name__)


class Hub:
    """The live sessions of one app and the tasks that serve them."""

    def __init__(self, config: AppConfig, metrics: Metrics, executor: Executor) -> None:
        self.config = config
        self.metrics = metrics
        self.executor = executor
        self.engine: AsyncEngine | None = None
        self.sessions: dict[str, LiveSession] = {}
        self.connections: set[Connection] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self.closing = False
        self.keys = config.server.keys()
        self.no_connections = asyncio.Event()
        self.inputs = InputScheduler(executor, config.server.vad_threads)
        self._watchdog: asyncio.Task[None] | None = None

    def spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = asyncio.create_task(coro, name=name)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def capabilities(self) -> ev.Capabilities:
        s, e = self.config.server, self.config.engine
        return ev.Capabilities(
            supports_barge_in=True,
            supports_session_resume=True,
            input_audio_formats=list(INPUT_FORMATS),
            output_audio_formats=list(OUTPUT_FORMATS),
            turn_detection=["server_vad", "semantic_vad", "none"],
            vad_backend=e.vad.backend,
            max_frame_bytes=s.max_frame_bytes,
            journal_max_bytes=s.journal_max_bytes,
            journal_max_age_s=s.journal_max_age_s,
        )

    def ensure_watchdog(self) -> None:
        if self._watchdog is None or self._watchdog.done():
            self._watchdog = self.spawn(self._watch_sends(), "send-watchdog")

    async def _watch_sends(self) -> None:
        """Slow-client policy: a frame whose send has not finished in ``send_timeout_s``."""
        timeout = self.config.server.send_timeout_s
        interval = min(1.0, timeout / 5)
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(interval)
            now = loop.time()
            for conn in list(self.connections):
                since = conn.send_since
                if since is not None and now - since > timeout:
                    conn.send_stalled()

    def _ended(self, session: LiveSession) -> None:
        self.sessions.pop(session.session_id, None)

    async def open_session(self, conn: Connection, beta: bool) -> LiveSession:
        engine = self.engine
        assert engine is not None
        cfg = EffectiveSession(
            instructions=self.config.engine.default_instructions,
            event_names="beta" if beta else "ga",
            model=self.config.server.model_name,
        )
        res = await engine.open(
            SessionConfig(
                instructions=cfg.instructions,
                output_modalities=cfg.output_modalities,
                output_sample_rate=24000,
            ),
            route_key=self.config.server.route_key,
        )
        assert res.session_id is not None
        core = SessionCore(
            res.session_id,
            cfg,
            lease_generation=res.lease_generation,
            encode_output=OutputEncoder().encode,
        )
        s = self.config.server
        session = LiveSession(
            engine,
            core,
            Journal(s.journal_max_bytes, s.journal_max_age_s),
            self.metrics,
            self._ended,
        )
        self.sessions[session.session_id] = session
        session.conn = conn
        conn.session = session
        session.start(self.spawn)
        session.apply(core.opened(session.token, self.capabilities()))
        return session

    async def resume_session(self, conn: Connection, req: ev.SessionResume) -> LiveSession:
        engine = self.engine
        assert engine is not None
        session = self.sessions.get(req.session_id)
        if session is None or session.core.closed:
            raise SessionFatal("session_not_found", f"no live session {req.session_id}")
        if not token_matches(req.resume_token, session.token_hash):
            raise SessionFatal("invalid_resume_token", "the resume token does not match")
        if session.resuming:
            raise SessionFatal("stale_lease", "another resume of this session is in progress")
        session.resuming = True
        try:
            res = await engine.resume(req.session_id, session.core.lease_generation)
        finally:
            session.resuming = False
        core = session.core
        core.lease_generation = res.lease_generation
        token = session.rotate_token()
        old = session.conn
        if old is not None:  # takeover: the old socket is told and its later writes refused
            session.drain_to_journal(old)
            old.replaced(session.stamper.seq)
            old.session = None
        session.conn = conn
        conn.session = session
        now = time.monotonic()
        replay = session.journal.replay_after(req.last_received_server_event_seq, now)
        conn.lane.configure(core.config.input_format, core.config.turn_detection)
        if replay is None:
            session.emit(
                ev.ResyncRequired(
                    reason="events after the given seq are no longer journaled",
                    first_available_seq=session.journal.first_available,
                    last_seq=session.stamper.seq,
                )
            )
            replayed = 0
        else:
            for data in replay:
                conn.outbox.put_raw(data)
            replayed = len(replay)
        session.emit(
            ev.SessionResumed(
                session_id=session.session_id,
                resume_token=token,
                replayed=replayed,
                lease_generation=res.lease_generation,
            )
        )
        return session

    async def shutdown(self, grace_s: float) -> None:
        """Ordered: stop accepting, tell sockets (1001), wait up to grace, cancel the rest."""
        self.closing = True
        for conn in list(self.connections):
            conn.close_after_flush(CloseCode.GOING_AWAY, "server shutting down")
        if self.connections:
            self.no_connections.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.no_connections.wait(), grace_s)
        for task in list(self.tasks):
            task.cancel()
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=grace_s)


class Connection:
    """One WebSocket; attached to at most one live session at a time."""

    def __init__(self, hub: Hub, ws: WebSocket) -> None:
        self.hub = hub
        self.ws = ws
        s = hub.config.server
        self.outbox = Outbox(s.output_buffer_bytes)
        self.session: LiveSession | None = None
        self._close: tuple[int, str] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._writer_task: asyncio.Task[None] | None = None
        self._stalled = False
        #: loop time when the frame being written started (None: not in a send)
        self.send_since: float | None = None
        vad_backend = hub.config.engine.vad.backend
        self.lane = InputLane(
            hub.inputs, vad_backend, s.input_backlog_bytes, self._processed, self._input_failed
        )

    # ------------------------------------------------------------------ called by the session
    def close_after_flush(self, code: int, reason: str) -> None:
        if self._close is None:
            self._close = (code, reason)
        self.outbox.wake.set()

    def too_slow(self) -> None:
        session = self.session
        if session is None or self._close is not None:
            return
        self.outbox.drain()
        session.conn = None  # the session ends; nothing more is queued for this socket
        self.session = None
        self.hub.metrics.errors.labels("client_too_slow").inc()
        now = time.monotonic()
        detail, _ = to_wire_error(SessionFatal("client_too_slow", "the client reads too slowly"))
        self.outbox.put_raw(session.stamper.stamp(ev.Error(error=detail), now))
        for action in session.core.close("client_too_slow"):
            if isinstance(action, Send):
                self.outbox.put_raw(session.stamper.stamp(action.event, now))
            elif isinstance(action, Call):
                session.apply([action])
        self.close_after_flush(CloseCode.POLICY, "client_too_slow")

    def replaced(self, seq: int) -> None:
        data, _ = encode_server_event(
            ev.SessionReplaced(), event_id=f"event_replaced_{seq}", seq=seq
        )
        self.outbox.drain()
        self.outbox.put_raw(data)
        self.close_after_flush(CloseCode.NORMAL, "replaced")

    def send_stalled(self) -> None:
        """The watchdog saw a send outlast ``send_timeout_s``: stop the writer (too slow)."""
        task = self._writer_task
        if task is not None and not task.done() and not self._stalled:
            self._stalled = True
            task.cancel()

    def _processed(self, pcm: bytes, vad: list[Any]) -> None:
        session = self.session
        if session is not None:
            session.apply(session.core.on_input_audio(pcm, vad, now_ms()))

    def _input_failed(self, exc: BaseException) -> None:
        log.error("input processing failed", exc_info=exc)
        session = self.session
        if session is not None:
            close = CloseSocket(CloseCode.INTERNAL, "server_error")
            session.apply([*session.core.error(exc), close])

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
            self.lane.close()

    async def _reader(self) -> None:
        try:
            await self._read_loop()
        except WebSocketDisconnect:
            pass
        finally:
            if self._close is None:  # the client went away: stop everything now
                self._stop()

    async def _read_loop(self) -> None:
        max_frame = self.hub.config.server.max_frame_bytes
        while True:
            msg = await self.ws.receive()
            if msg["type"] == "websocket.disconnect":
                return
            session = self.session
            text, data = msg.get("text"), msg.get("bytes")
            size = len(text) if text is not None else len(data or b"")
            if size > max_frame:
                exc = SessionFatal("frame_too_large", f"frame of {size} bytes is over {max_frame}")
                self._fatal(exc)
                return
            if session is None:
                continue  # replaced or closed: later input is refused silently
            if text is not None:
                try:
                    event = decode_client_event(text)
                except ProtocolError as exc:
                    session.apply(session.core.error(exc))
                    continue
                session.apply(session.core.on_client_event(event, now_ms()))
            elif data:
                session.apply(session.core.on_binary_audio(data))

    def _fatal(self, exc: ProtocolError) -> None:
        session = self.session
        if session is not None:
            session.apply(session.core.error(exc))
        else:
            detail, code = to_wire_error(exc)
            data, _ = encode_server_event(ev.Error(error=detail), event_id="event_error", seq=0)
            self.outbox.put_raw(data)
            self.close_after_flush(code or CloseCode.POLICY, detail.code)

    async def _writer(self) -> None:
        try:
            await self._write_loop()
        except WebSocketDisconnect:
            pass  # the client went away mid-send: nothing more to write (it can resume)
        except asyncio.CancelledError:
            if not self._stalled:
                raise
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            self.too_slow()  # cancelled by the send watchdog: the client reads too slowly
        finally:
            self._stop()

    async def _write_loop(self) -> None:
        metrics = self.hub.metrics
        loop = asyncio.get_running_loop()
        send = self.ws.send_text
        while True:
            item = self.outbox.pop()
            if item is None:
                if self._close is not None:
                    break
                await self.outbox.wake.wait()
                continue
            session = self.session
            if item.raw is not None:
                data = item.raw
            else:
                assert item.event is not None
                if session is None:
                    continue
                if item.epoch is not None and item.epoch < session.core.epoch:
                    metrics.stale_dropped.labels("writer").inc()
                    continue  # third drop: never a byte of a cancelled response
                data = session.stamper.stamp(item.event, time.monotonic())
            self.send_since = loop.time()  # the hub watchdog enforces send_timeout_s
            try:
                await send(data.decode())
            finally:
                self.send_since = None
            if item.event is not None and session is not None:
                self._observe(session, item.event, item.t_in)
        code, reason = self._close or (CloseCode.NORMAL, "")
        await self.ws.close(code, reason)

    def _observe(self, session: LiveSession, event: ev.ServerEvent, t_in: float) -> None:
        metrics = self.hub.metrics
        now = time.perf_counter()
        if isinstance(event, ev.AudioDelta):
            if t_in:
                metrics.chunk_overhead.observe(now - t_in)
            if session.commit_t is not None:
                metrics.ttfa.observe(now - session.commit_t)
                session.commit_t = None
        elif isinstance(event, ev.ResponseDone) and event.response.status == "cancelled":
            if session.cancel_t is not None:
                metrics.bargein.observe(now - session.cancel_t)
                session.cancel_t = None


def _beta(ws: WebSocket) -> bool:
    header = ws.headers.get("openai-beta", "")
    return "realtime=v1" in header or ws.query_params.get("event_names") == "beta"


async def realtime_endpoint(ws: WebSocket) -> None:
    hub: Hub = ws.app.state.hub
    s = hub.config.server
    offered = ws.scope.get("subprotocols", [])
    adm = admit(ws.headers, offered, keys=hub.keys, allowed_origins=s.allowed_origins)
    await ws.accept(subprotocol=adm.subprotocol)
    conn = Connection(hub, ws)
    hub.connections.add(conn)
    hub.metrics.connections.labels("open").inc()
    try:
        outcome = await _handshake(hub, conn, adm.ok, adm.code, adm.message)
        hub.metrics.connection_outcomes.labels(outcome).inc()
        if outcome != "disconnected":
            await conn.serve()
    finally:
        hub.connections.discard(conn)
        if not hub.connections:
            hub.no_connections.set()
        hub.metrics.connections.labels("open").dec()
        session = conn.session
        if session is not None:
            session.detach(conn)
        await _close_quietly(ws)


async def _handshake(hub: Hub, conn: Connection, ok: bool, code: str, message: str) -> str:
    """Admit, then open a new session or resume one. Returns the outcome label."""
    try:
        if not ok:
            raise SessionFatal(code, message)
        if hub.closing or hub.engine is None or not hub.engine.ready:
            raise SessionFatal(
                "engine_unavailable", "the engine is not ready", close_code=CloseCode.TRY_AGAIN
            )
        if conn.ws.query_params.get("intent") == "resume":
            msg = await asyncio.wait_for(conn.ws.receive(), hub.config.server.resume_wait_s)
            if msg["type"] == "websocket.disconnect":
                raise WebSocketDisconnect(msg.get("code", 1000))
            first = msg.get("text")
            if first is None:
                raise SessionFatal(
                    "invalid_state", "expected session.resume as a text frame", close_code=1008
                )
            event = decode_client_event(first)
            if not isinstance(event, ev.SessionResume):
                raise SessionFatal("invalid_state", "expected session.resume", close_code=1008)
            await hub.resume_session(conn, event)
            return "resumed"
        await hub.open_session(conn, _beta(conn.ws))
        return "opened"
    except WebSocketDisconnect:
        return "disconnected"
    except TimeoutError:
        conn._fatal(SessionFatal("resume_timeout", "no session.resume in time"))
        return "resume_timeout"
    except (ProtocolError, EngineError) as exc:
        detail, close = to_wire_error(exc)
        if close is None:
            close = CloseCode.POLICY
        conn._fatal(SessionFatal(detail.code, detail.message, close_code=close))
        return detail.code


async def _close_quietly(ws: WebSocket) -> None:
    try:
        await ws.close(CloseCode.NORMAL)
    except Exception:  # already closed by the peer or by the writer: nothing to do
        log.debug("socket already closed", exc_info=True)
