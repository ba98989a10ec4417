"""The engine client's state and plumbing, which :class:`engine.api.client.AsyncEngine` builds
on: the control-call waiters and their router, the session and batch mailboxes, and the
engine's death.

Each control call carries a ``control_id``; one router task resolves the waiting future. A
timeout unregisters the waiter and a late reply is dropped (and logged); a fatal engine error
fails every pending waiter and every later call at once with :class:`EngineDeadError`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import janus

from duplex_contract.control import ControlCall, ControlResult, OpenCall
from duplex_contract.errors import ControlError, EngineDeadError
from duplex_contract.events import SessionLifecycle
from engine.config import EngineConfig
from engine.messages import (
    BatchOutput,
    ControlRequest,
    EngineFatal,
    EngineOutput,
    EngineRequest,
)

if TYPE_CHECKING:
    from engine.orchestration.orchestrator import Orchestrator

log = logging.getLogger(__name__)
_END: Any = object()


class RequestSink(Protocol):
    """Where requests go: the orchestrator's janus queue, or a socket to an engine process.
    ``put_nowait`` raises RuntimeError once the engine is gone."""

    def put_nowait(self, item: EngineRequest) -> None: ...

    def qsize(self) -> int: ...


class EngineClientCore:
    """The client's state and the routing every part of it uses;
    :class:`engine.api.client.AsyncEngine` builds on it."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._ids = itertools.count(1)
        self._waiters: dict[int, asyncio.Future[ControlResult]] = {}
        self._sessions: dict[str, asyncio.Queue[Any]] = {}
        self._batches: dict[str, asyncio.Queue[Any]] = {}
        self._dead: EngineDeadError | None = None
        self._ready = False
        self._req: RequestSink | None = None
        # session events, batch items and the fatal error, one message per put
        self._out: janus.Queue[EngineOutput] | None = None
        self._rpc: janus.Queue[Any] | None = None
        self._orch: Orchestrator | None = None
        self._thread: threading.Thread | None = None
        self._thread_done: asyncio.Future[None] | None = None
        self._router: list[asyncio.Task[None]] = []
        self._shutdown_lock = asyncio.Lock()
        self._dead_hooks: list[Callable[[EngineDeadError], None]] = []
        self.late_replies = 0

    def on_dead(self, hook: Callable[[EngineDeadError], None]) -> None:
        """Call ``hook`` (on this loop) once, when the engine dies or is shut down."""
        self._dead_hooks.append(hook)

    def _die(self, exc: EngineDeadError) -> None:
        first = self._dead is None
        if self._dead is None:
            self._dead = exc
        for fut in self._waiters.values():
            if not fut.done():
                fut.set_exception(self._dead)
        self._waiters.clear()
        for q in [*self._sessions.values(), *self._batches.values()]:
            q.put_nowait(_END)
        if first:
            for hook in self._dead_hooks:
                try:
                    hook(self._dead)
                except Exception:
                    log.exception("engine death hook failed")

    # ------------------------------------------------------------------ routers
    async def _route_rpc(self) -> None:
        assert self._rpc is not None
        q = self._rpc.async_q
        while True:
            self._on_rpc(await q.get())

    async def _route_outputs(self) -> None:
        assert self._out is not None
        q = self._out.async_q
        while True:
            self._on_output(await q.get())

    def _on_rpc(self, msg: ControlResult | EngineFatal) -> None:
        """A control result (or the fatal error) arrived from the engine: wake its caller."""
        if isinstance(msg, EngineFatal):
            self._die(EngineDeadError(msg.error.message))
            return
        fut = self._waiters.pop(msg.control_id, None)
        if fut is None or fut.done():
            self.late_replies += 1
            log.info("dropped late control reply %s", msg.control_id)
            return
        fut.set_result(msg)

    def _on_output(self, msg: EngineOutput) -> None:
        """A session event or batch item arrived from the engine: route it to its reader."""
        if isinstance(msg, EngineFatal):
            self._die(EngineDeadError(msg.error.message))
        elif isinstance(msg, BatchOutput):
            bq = self._batches.get(msg.request_id)
            if bq is not None:
                bq.put_nowait(msg)
        else:
            mailbox = self._mailbox(msg.session_id)
            mailbox.put_nowait(msg.event)
            ev = msg.event
            if isinstance(ev, SessionLifecycle) and ev.state == "closed":
                mailbox.put_nowait(_END)

    def _mailbox(self, sid: str) -> asyncio.Queue[Any]:
        box = self._sessions.get(sid)
        if box is None:
            box = self._sessions[sid] = asyncio.Queue()
        return box

    # ------------------------------------------------------------------ control RPCs
    def _check(self) -> RequestSink:
        if self._dead is not None:
            raise self._dead
        if self._req is None:
            raise EngineDeadError("engine not started")
        return self._req

    def _send(self, msg: EngineRequest) -> None:
        try:
            self._check().put_nowait(msg)
        except RuntimeError as exc:  # queue closed: the orchestrator is gone
            self._die(EngineDeadError(f"engine stopped: {exc}"))
            raise self._dead from None  # type: ignore[misc]

    def submit_call(self, call: ControlCall) -> tuple[int, asyncio.Future[ControlResult]]:
        """Send one control call now (calls keep their order); its result arrives on the
        future, ``ok`` False included. The caller must pop ``_waiters[id]`` when done."""
        req = self._check()
        cid = next(self._ids)
        fut: asyncio.Future[ControlResult] = asyncio.get_running_loop().create_future()
        self._waiters[cid] = fut
        try:
            req.put_nowait(ControlRequest(control_id=cid, call=call))
        except RuntimeError:
            self._die(EngineDeadError("engine stopped"))
        return cid, fut

    async def call(self, call: ControlCall, wait_s: float | None = None) -> ControlResult:
        """Send one control call; raise its error if ``ok`` is False. An opened session's
        mailbox exists from then on (its events wait there until someone reads them)."""
        cid, fut = self.submit_call(call)
        try:
            # not asyncio.wait_for: on Python 3.11 it swallows a cancellation that arrives as
            # the result does, and a session's caller cancelled then never ended (its session
            # stayed live in the front end for good)
            async with asyncio.timeout(wait_s or self.config.control_timeout_s):
                res = await fut
        except TimeoutError:
            raise ControlError("engine did not answer in time", code="deadline_exceeded") from None
        finally:
            self._waiters.pop(cid, None)
        if not res.ok:
            assert res.error is not None
            raise res.error.to_exc()
        if isinstance(call, OpenCall):
            assert res.session_id is not None
            self._mailbox(res.session_id)
        return res
