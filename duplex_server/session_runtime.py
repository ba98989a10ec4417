"""A live session on the server side: the protocol core, its journal, its engine tasks.

:class:`LiveSession` outlives its sockets. It owns two tasks in the hub's task set: the
engine pump (engine session events -> core) and the caller (the session's one ordered
mailbox of engine calls: they run in the order the core decided them). It executes the
core's actions; it makes no protocol decisions of its own.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from duplex_server.attach import Journal, Outgoing, Stamper, new_resume_token
from duplex_server.metrics import Metrics
from duplex_server.protocol import events as ev
from duplex_server.protocol.commands import (
    AckJournal,
    Action,
    Append,
    Call,
    Cancel,
    CloseSession,
    CloseSocket,
    Commit,
    ConfigureInput,
    EngineCommand,
    ProcessAudio,
    PurgeAudio,
    Send,
    Speculate,
    Touch,
    Update,
)
from duplex_server.protocol.session import SessionCore
from engine.client import AsyncEngine
from engine.errors import EngineDeadError
from engine.messages import AudioChunk, Fence, PlaybackMark, SessionUpdate

if TYPE_CHECKING:
    from duplex_server.realtime import Connection

log = logging.getLogger(__name__)


def now_ms() -> float:
    return time.monotonic() * 1000.0


class LiveSession:
    def __init__(
        self,
        engine: AsyncEngine,
        core: SessionCore,
        journal: Journal,
        metrics: Metrics,
        on_end: Callable[[LiveSession], None],
    ) -> None:
        self.engine = engine
        self.core = core
        self.journal = journal
        self.stamper = Stamper(core.session_id, journal)
        self.stamper.beta = core.beta
        self.metrics = metrics
        self.token, self.token_hash = new_resume_token()
        self.conn: Connection | None = None
        self._calls = _CallQueue()
        self._on_end = on_end
        self.tasks: list[asyncio.Task[None]] = []
        self.cancel_t: float | None = None
        self.commit_t: float | None = None
        self.resuming = False

    @property
    def session_id(self) -> str:
        return self.core.session_id

    def start(self, spawn: Callable[..., asyncio.Task[None]]) -> None:
        sid = self.session_id
        self.tasks = [spawn(self._pump(), f"pump:{sid}"), spawn(self._caller(), f"calls:{sid}")]

    def rotate_token(self) -> str:
        self.token, self.token_hash = new_resume_token()
        return self.token

    # ------------------------------------------------------------------ actions
    def apply(self, actions: list[Action], *, t_in: float = 0.0) -> None:
        conn = self.conn
        for action in actions:
            if isinstance(action, Send):
                self.emit(action.event, t_in=t_in)
            elif isinstance(action, Call):
                cmd = action.command
                if isinstance(cmd, Cancel):
                    self.cancel_t = time.perf_counter()
                elif isinstance(cmd, Commit) and cmd.respond:
                    self.commit_t = time.perf_counter()
                self._calls.put_nowait(cmd)
            elif isinstance(action, ProcessAudio):
                if conn is not None and not conn.lane.put(action.data):
                    self.apply(self.core.error(_backpressure()))
            elif isinstance(action, ConfigureInput):
                if conn is not None:
                    conn.lane.configure(action.format, action.turn_detection)
            elif isinstance(action, PurgeAudio):
                if conn is not None:
                    dropped = conn.outbox.purge_audio(action.epoch)
                    if dropped:
                        self.metrics.stale_dropped.labels("queue").inc(dropped)
            elif isinstance(action, AckJournal):
                self.journal.ack(action.seq)
            elif isinstance(action, CloseSocket):
                if conn is not None:
                    conn.close_after_flush(action.code, action.reason)

    def emit(self, event: ev.ServerEvent, *, t_in: float = 0.0) -> None:
        if isinstance(event, ev.Error):
            self.metrics.errors.labels(event.error.code).inc()
        self.stamper.beta = self.core.beta
        conn = self.conn
        if conn is None:
            self.stamper.stamp(event, time.monotonic())
            return
        epoch = event.epoch if isinstance(event, ev.AudioDelta) else None
        size = len(event.delta) + 256 if isinstance(event, ev.AudioDelta) else 512
        if not conn.outbox.put(Outgoing(event, None, size, epoch, t_in)):
            conn.too_slow()

    def drain_to_journal(self, conn: Connection) -> None:
        """A socket went away: journal what it never wrote, in order (for resume)."""
        now = time.monotonic()
        for item in conn.outbox.drain():
            if item.event is not None:
                if item.epoch is not None and item.epoch < self.core.epoch:
                    continue
                self.stamper.stamp(item.event, now)

    def detach(self, conn: Connection) -> None:
        if self.conn is not conn:
            return
        self.drain_to_journal(conn)
        self.conn = None
        if not self.core.closed:
            self._calls.put_nowait(Touch(self.core.epoch, "detach"))

    # ------------------------------------------------------------------ tasks
    async def _pump(self) -> None:
        try:
            async for event in self.engine.session_events(self.session_id):
                t_in = time.perf_counter() if isinstance(event, AudioChunk) else 0.0
                self.apply(self.core.on_engine_event(event, now_ms()), t_in=t_in)
        except EngineDeadError as exc:
            self.apply(self.core.error(exc))
        finally:
            for task in self.tasks:
                if task is not asyncio.current_task():
                    task.cancel()
            self._on_end(self)

    async def _caller(self) -> None:
        while True:
            cmd = self._merge_appends(await self._calls.get())
            try:
                res_fence = await self._execute(cmd)
            except Exception as exc:  # every engine error is reported to the client
                if isinstance(cmd, CloseSession):
                    log.info("%s: close failed: %s", self.session_id, exc)
                    continue
                self.apply(self.core.on_failure(cmd, exc))
                if isinstance(exc, EngineDeadError):
                    return
                continue
            self.core.on_result(cmd, res_fence)

    def _merge_appends(self, cmd: EngineCommand) -> EngineCommand:
        """Audio appends queued behind this one (same epoch) go to the engine as one call.

        Under load the engine round trip can lag the microphone; merging keeps the queue
        short, so a barge-in or commit queued behind audio is not delayed by it.
        """
        if not isinstance(cmd, Append) or cmd.text is not None or not cmd.audio:
            return cmd
        parts = [cmd.audio]
        while isinstance(nxt := self._calls.peek(), Append):
            if nxt.epoch != cmd.epoch or nxt.text is not None or not nxt.audio:
                break
            self._calls.get_nowait()
            parts.append(nxt.audio)
        if len(parts) == 1:
            return cmd
        return Append(cmd.epoch, audio=b"".join(parts), event_id=cmd.event_id)

    async def _execute(self, cmd: EngineCommand) -> Fence | None:
        core, eng = self.core, self.engine
        gen = core.lease_generation
        if isinstance(cmd, CloseSession):
            res = await eng.close(core.fence_for(core.epoch), gen, reason=cmd.reason)
            return None
        fence = core.fence_for(cmd.epoch)
        if isinstance(cmd, Append):
            res = await eng.append(fence, gen, audio=cmd.audio, text=cmd.text)
        elif isinstance(cmd, Commit):
            res = await eng.commit(fence, gen, respond=cmd.respond)
        elif isinstance(cmd, Cancel):
            nxt = Fence(fence.session_id, cmd.epoch + 1, fence.turn_id, fence.response_seq)
            res = await eng.signal(fence, gen, cmd.event, next_fence=nxt)
        elif isinstance(cmd, Speculate):
            res = await eng.signal(fence, gen, cmd.event)
        elif isinstance(cmd, Update):
            upd = SessionUpdate.replace_with(cmd.settings)
            res = await eng.signal(fence, gen, "session.update", update=upd)
        else:
            mark = None
            if cmd.activity == "playback_ack":
                mark = PlaybackMark(cmd.turn_id, cmd.response_seq, cmd.played_ms, cmd.truncate)
            res = await eng.touch(fence, gen, cmd.activity, playback=mark)
        return res.accepted_fence


def _backpressure() -> Exception:
    from duplex_server.protocol.errors import ProtocolError

    return ProtocolError(
        "input_backpressure",
        "input audio backlog is full; the audio was dropped (send slower)",
        error_type="rate_limit_error",
    )


class _CallQueue:
    """The session's ordered engine calls (FIFO, unbounded: its producers are bounded)."""

    def __init__(self) -> None:
        self._items: deque[EngineCommand] = deque()
        self._ready = asyncio.Event()

    def put_nowait(self, cmd: EngineCommand) -> None:
        self._items.append(cmd)
        self._ready.set()

    async def get(self) -> EngineCommand:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        return self._items.popleft()

    def peek(self) -> EngineCommand | None:
        return self._items[0] if self._items else None

    def get_nowait(self) -> EngineCommand:
        return self._items.popleft()
