"""AsyncEngine: the engine's proxy in the server's event loop, and the RPC router.

Three janus queues connect it to the orchestrator thread: requests (server -> engine),
outputs (session events and batch items) and rpc (control results). Each control call
carries a ``control_id``; one router task resolves the waiting future. A timeout
unregisters the waiter and a late reply is dropped (and logged); a fatal engine error fails
every pending waiter and every later call at once with :class:`EngineDeadError`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import janus
from opentelemetry.trace import Tracer

from engine.config import EngineConfig
from engine.errors import ControlError, EngineDeadError, EngineError
from engine.messages import (
    AbortRequest,
    Activity,
    AppendCall,
    BatchDone,
    BatchItem,
    BatchJob,
    BatchOutput,
    CloseCall,
    CommitCall,
    ControlCall,
    ControlRequest,
    ControlResult,
    EngineFatal,
    EngineOutput,
    EngineRequest,
    Fence,
    GenerateRequest,
    ItemRef,
    OpenCall,
    PlaybackMark,
    ReplicaCall,
    ResponseOptions,
    ResumeCall,
    SessionConfig,
    SessionEvent,
    SessionLifecycle,
    SessionUpdate,
    ShutdownRequest,
    SignalCall,
    SignalEvent,
    ToolOutput,
    TouchCall,
)
from engine.orchestrator import Orchestrator
from engine.speculation import SpeculativeAsr
from engine.stage_figures import StageEngineFigures, stage_engine_figures
from engine.stages.base import StageBackend
from engine.tracing import EngineTracing

log = logging.getLogger(__name__)
_END: Any = object()


class RequestSink(Protocol):
    """Where requests go: the orchestrator's janus queue, or a socket to an engine process.
    ``put_nowait`` raises RuntimeError once the engine is gone."""

    def put_nowait(self, item: EngineRequest) -> None: ...

    def qsize(self) -> int: ...


@dataclass(frozen=True)
class EngineStats:
    sessions: dict[str, int]
    admissions: dict[str, int]
    stale_chunks_dropped: int
    request_queue_depth: int
    output_queue_depth: int
    pending_calls: int
    stage_restarts: dict[str, int]
    # stages that report themselves down (a remote stage whose circuit is open): why
    stages_down: dict[str, str] = field(default_factory=dict)
    # bytes the engine holds for its sessions, by part (engine_input, history, speculation)
    session_bytes: dict[str, int] = field(default_factory=dict)
    # speculative responses (engine/drafts.py) by outcome: started, used, dropped
    speculative_responses: dict[str, int] = field(default_factory=dict)
    # speculative transcripts of pauses (engine/speculation.py): started, skipped, used
    speculative_transcripts: dict[str, int] = field(default_factory=dict)
    # what the stages' own engines report (vLLM: running/waiting, KV cache use, tokens)
    stage_engines: dict[str, StageEngineFigures] = field(default_factory=dict)


def _guesses(spec: SpeculativeAsr | None) -> dict[str, int]:
    """Speculative transcripts of pauses by outcome (engine/speculation.py)."""
    if spec is None:
        return {}
    return {
        "started": spec.started,
        "skipped": spec.skipped,
        "used": spec.used,
        "reguessed": spec.reguesses,
    }


class AsyncEngine:
    """Create with ``await AsyncEngine.start(config)``; see docs/engine.md."""

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

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    async def start(
        cls,
        config: EngineConfig,
        backends: Mapping[str, Sequence[StageBackend]] | None = None,
        *,
        tracer: Tracer | None = None,
    ) -> AsyncEngine:
        """``tracer``: record a span per stage request in the callers' traces
        (engine/tracing.py); None: no spans."""
        self = cls(config)
        await self._start(backends, tracer)
        return self

    async def _start(
        self, backends: Mapping[str, Sequence[StageBackend]] | None, tracer: Tracer | None
    ) -> None:
        loop = asyncio.get_running_loop()
        self._out = janus.Queue()
        self._rpc = janus.Queue()
        self._orch = Orchestrator(
            self.config, self._out.sync_q, self._rpc.sync_q, backends, EngineTracing(tracer)
        )
        self._thread_done = loop.create_future()
        done = self._thread_done

        def finished() -> None:
            if not done.done():
                done.set_result(None)

        def main() -> None:
            assert self._orch is not None
            try:
                self._orch.run()
            finally:
                try:
                    loop.call_soon_threadsafe(finished)
                except RuntimeError:
                    pass

        self._thread = threading.Thread(target=main, name="engine-orchestrator", daemon=True)
        self._thread.start()
        try:
            self._req = await asyncio.wrap_future(self._orch.started)
        except BaseException:
            await done
            await self._close_queues()
            raise
        self._router = [
            asyncio.create_task(self._route_rpc(), name="engine-rpc-router"),
            asyncio.create_task(self._route_outputs(), name="engine-output-router"),
        ]
        self._ready = True

    @property
    def ready(self) -> bool:
        return self._ready and self._dead is None

    async def shutdown(self) -> None:
        """Stop the orchestrator and unblock every waiter; safe to call twice."""
        async with self._shutdown_lock:
            if self._thread_done is None:
                return
            self._ready = False
            if not self._thread_done.done() and self._req is not None:
                try:
                    self._req.put_nowait(ShutdownRequest())
                except RuntimeError:
                    pass
                try:
                    await asyncio.wait_for(asyncio.shield(self._thread_done), 15.0)
                except TimeoutError:
                    log.error("orchestrator did not stop within 15 s")
            if self._thread is not None:
                self._thread.join(timeout=1.0)
            self._die(EngineDeadError("engine shut down"))
            for task in self._router:
                task.cancel()
            await asyncio.gather(*self._router, return_exceptions=True)
            self._router = []
            await self._close_queues()
            self._thread_done = None

    async def _close_queues(self) -> None:
        for q in (self._out, self._rpc):
            if q is not None:
                q.close()
                await q.wait_closed()

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
        """Send one control call; raise its error if ``ok`` is False."""
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
        return res

    async def open(
        self,
        config: SessionConfig | None = None,
        *,
        route_key: str | None = None,
        traceparent: str | None = None,
    ) -> ControlResult:
        call = OpenCall(
            config=config or SessionConfig(), route_key=route_key, traceparent=traceparent
        )
        res = await self.call(call)
        assert res.session_id is not None
        self._mailbox(res.session_id)
        return res

    async def append(
        self,
        fence: Fence,
        lease_generation: int,
        *,
        audio: bytes = b"",
        text: str | None = None,
        seq: int | None = None,
        operation_id: str | None = None,
        expected_epoch: int | None = None,
        item_id: str | None = None,
        tool_output: ToolOutput | None = None,
        stream_ms: float | None = None,
    ) -> ControlResult:
        return await self.call(
            AppendCall(
                fence=fence,
                lease_generation=lease_generation,
                audio=audio,
                text=text,
                seq=seq,
                operation_id=operation_id,
                expected_epoch=expected_epoch,
                item_id=item_id,
                tool_output=tool_output,
                stream_ms=stream_ms,
            )
        )

    async def commit(
        self,
        fence: Fence,
        lease_generation: int,
        *,
        respond: bool = True,
        operation_id: str | None = None,
        item_id: str | None = None,
        response: ResponseOptions | None = None,
        traceparent: str | None = None,
    ) -> ControlResult:
        return await self.call(
            CommitCall(
                fence=fence,
                lease_generation=lease_generation,
                respond=respond,
                operation_id=operation_id,
                item_id=item_id,
                response=response,
                traceparent=traceparent,
            )
        )

    async def signal(
        self,
        fence: Fence,
        lease_generation: int,
        event: SignalEvent,
        *,
        next_fence: Fence | None = None,
        update: SessionUpdate | None = None,
        operation_id: str | None = None,
        item: ItemRef | None = None,
        respond: bool = True,
        traceparent: str | None = None,
    ) -> ControlResult:
        return await self.call(
            SignalCall(
                fence=fence,
                lease_generation=lease_generation,
                event=event,
                next_fence=next_fence,
                update=update,
                operation_id=operation_id,
                item=item,
                respond=respond,
                traceparent=traceparent,
            )
        )

    async def touch(
        self,
        fence: Fence,
        lease_generation: int,
        activity: Activity,
        *,
        playback: PlaybackMark | None = None,
    ) -> ControlResult:
        return await self.call(
            TouchCall(
                fence=fence, lease_generation=lease_generation, activity=activity, playback=playback
            )
        )

    async def resume(
        self, session_id: str, expected_lease_generation: int, *, peek: bool = False
    ) -> ControlResult:
        """Renew the lease (compare and swap); ``peek``: change nothing, return the lease
        generation, the front end's replica and the engine's input seq."""
        return await self.call(
            ResumeCall(
                session_id=session_id,
                expected_lease_generation=expected_lease_generation,
                peek=peek,
            )
        )

    async def replicate(self, fence: Fence, lease_generation: int, state: bytes) -> ControlResult:
        """Keep the front end's state of a session in the engine (engine/duplex/replica.py)."""
        return await self.call(
            ReplicaCall(fence=fence, lease_generation=lease_generation, state=state)
        )

    async def close(
        self, fence: Fence, lease_generation: int, reason: str = "client"
    ) -> ControlResult:
        return await self.call(
            CloseCall(fence=fence, lease_generation=lease_generation, reason=reason)
        )

    # ------------------------------------------------------------------ streams
    async def session_events(self, session_id: str) -> AsyncIterator[SessionEvent]:
        """Typed events of one session; ends after SessionLifecycle(state='closed').

        Events wait in the session's mailbox while nobody iterates, so a consumer that
        stops (a dropped socket) and a new one (the resumed socket) see one unbroken stream.
        """
        box = self._mailbox(session_id)
        closed = False
        while True:
            item = await box.get()
            if item is _END:
                if self._sessions.get(session_id) is box:
                    del self._sessions[session_id]
                if self._dead is not None and not closed:
                    raise self._dead
                return
            if isinstance(item, SessionLifecycle) and item.state == "closed":
                closed = True
            yield item

    async def generate(
        self, job: BatchJob, request_id: str | None = None
    ) -> AsyncIterator[BatchItem]:
        """Run one batch job; yields its items and ends after BatchDone."""
        rid = request_id or f"req_{uuid.uuid4().hex}"
        box: asyncio.Queue[Any] = asyncio.Queue()
        self._batches[rid] = box
        try:
            self._send(GenerateRequest(request_id=rid, job=job))
            while True:
                item = await box.get()
                if item is _END:
                    raise self._dead or EngineDeadError("engine stopped")
                assert isinstance(item, BatchOutput)
                if item.error is not None:
                    raise item.error.to_exc()
                assert item.item is not None
                yield item.item
                if isinstance(item.item, BatchDone):
                    return
        finally:
            if self._batches.pop(rid, None) is not None and self._dead is None:
                self._send(AbortRequest(request_id=rid))

    async def abort(self, request_id: str) -> None:
        self._send(AbortRequest(request_id=request_id))

    # ------------------------------------------------------------------ observability
    def stats(self) -> EngineStats:
        orch = self._orch
        if orch is None:
            raise EngineError("engine not started")
        control = orch.control
        return EngineStats(
            sessions=control.counts(),
            admissions=dict(control.admissions),
            stale_chunks_dropped=orch.counters.stale_dropped,
            request_queue_depth=self._req.qsize() if self._req is not None else 0,
            output_queue_depth=self._out.sync_q.qsize() if self._out is not None else 0,
            pending_calls=len(self._waiters),
            stage_restarts={
                name: sum(getattr(r, "restarts", 0) for r in pool.replicas)
                for name, pool in orch.pools.items()
            },
            stages_down=orch.stages_down(),
            session_bytes=dict(orch.counters.session_bytes),
            speculative_responses=dict(orch.counters.drafts),
            speculative_transcripts=_guesses(orch.speculation),
            stage_engines=stage_engine_figures({n: p.replicas for n, p in orch.pools.items()}),
        )

    def drain_stage_steps(self) -> list[tuple[str, int]]:
        """(stage, batch size) of each step the batching stages ran since the last drain."""
        return self._orch.counters.drain_steps() if self._orch is not None else []

    def drain_stage_latencies(self) -> list[tuple[str, float]]:
        """(stage, seconds to first output) of each stage request since the last drain."""
        return self._orch.counters.drain_latencies() if self._orch is not None else []

    def drain_stage_waits(self) -> list[tuple[str, float]]:
        """(stage, seconds from submit to the start of its work) since the last drain."""
        return self._orch.counters.drain_waits() if self._orch is not None else []

    def drain_stage_decodes(self) -> list[tuple[str, float, float]]:
        """(stage, decoder seconds, audio seconds) of each decoder step since the last drain."""
        return self._orch.counters.drain_decodes() if self._orch is not None else []
