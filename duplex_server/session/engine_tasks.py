"""A live session's two engine tasks, in one task group: the pump and the caller.

The pump reads the engine session's events and hands each to the session core
(``on_engine_event``); the caller makes the session's engine calls in order, from its one
mailbox (:class:`~duplex_server.session.engine_calls.CallQueue`), and gives the core each
result (``on_result``) or failure (``on_failure``: the client is told). When the engine
session ends (its event stream ends, or the engine dies) the caller ends too. The actions
the core returns go to the session's ``apply``.

:class:`EngineTasks` exists only while it runs (:meth:`LiveSession.run
<duplex_server.session.live.LiveSession.run>` builds it): nothing keeps it, or the session it
applies to, alive after the engine session ends.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Protocol

from duplex_contract.errors import ControlError, EngineDeadError, EngineError
from duplex_contract.fence import Fence
from duplex_contract.session_events import AudioChunk
from duplex_server.ops.tracing import SessionTrace
from duplex_server.protocol.commands import UNFENCED, Action, Commit, EngineCommand
from duplex_server.protocol.machine import SessionMachine
from duplex_server.session.engine_calls import CallQueue, EngineSessions, execute

log = logging.getLogger(__name__)


class Apply(Protocol):
    """The session's ``apply``: carry out the core's actions (``t_in``: engine output's
    arrival, perf_counter)."""

    def __call__(self, actions: list[Action], *, t_in: float = 0.0) -> None: ...


class EngineTasks:
    """The pump and the caller of one session; ``clock``: the session's monotonic ms."""

    def __init__(
        self,
        engine: EngineSessions,
        core: SessionMachine,
        calls: CallQueue,
        *,
        apply: Apply,
        clock: Callable[[], float],
        trace: SessionTrace | None = None,
    ) -> None:
        self.engine = engine
        self.core = core
        self.calls = calls
        self.apply = apply
        self.clock = clock
        self.trace = trace

    @property
    def session_id(self) -> str:
        return self.core.session_id

    async def run(self) -> None:
        """Serve the engine side until the engine session ends."""
        async with asyncio.TaskGroup() as tg:
            caller = tg.create_task(self._caller(), name=f"calls:{self.session_id}")
            pump = tg.create_task(self._pump(), name=f"pump:{self.session_id}")
            pump.add_done_callback(lambda _: self._stop_caller(caller))

    async def _pump(self) -> None:
        try:
            async for event in self.engine.session_events(self.session_id):
                t_in = time.perf_counter() if isinstance(event, AudioChunk) else 0.0
                self.apply(self.core.on_engine_event(event, self.clock()), t_in=t_in)
        except EngineDeadError as exc:
            self.apply(self.core.error(exc))

    async def _execute(self, cmd: EngineCommand) -> Fence | None:
        """One engine call. A call refused because this front end resumed the session while
        it was in flight (the lease moved on under it; the engine changed nothing) is made
        again under the new lease: input sent before a reconnect is not lost."""
        gen = self.core.lease_generation
        try:
            return await execute(self.engine, self.core, cmd)
        except ControlError as exc:
            if exc.code != "stale_fence" or self.core.lease_generation == gen:
                raise
        return await execute(self.engine, self.core, cmd)

    def _stop_caller(self, caller: asyncio.Task[None]) -> None:
        """The engine session ended: the caller ends too, even if the cancellation is lost
        (the stopped queue wakes the caller and hands it None)."""
        self.calls.stop()
        caller.cancel()

    async def _caller(self) -> None:
        while (queued := await self.calls.get()) is not None:
            cmd = self.calls.merge_appends(queued)
            self.calls.running += 1
            try:
                res_fence = await self._execute(cmd)
            except Exception as exc:  # every engine error is reported to the client
                if isinstance(cmd, UNFENCED):
                    log.info("%s: %s failed: %s", self.session_id, type(cmd).__name__, exc)
                    continue
                if not isinstance(exc, EngineError):  # a bug: the client sees server_error
                    log.error("%s: %s failed", self.session_id, type(cmd).__name__, exc_info=exc)
                if self.trace is not None and isinstance(cmd, Commit) and cmd.respond:
                    self.trace.turn_refused(exc)
                self.apply(self.core.on_failure(cmd, exc))
                if isinstance(exc, EngineDeadError):
                    return
                continue
            finally:
                self.calls.running -= 1
            self.core.on_result(cmd, res_fence)
