"""AsyncEngine: the engine's proxy in the server's event loop (see docs/engine.md).

Three janus queues connect it to the orchestrator thread: requests (server -> engine),
outputs (session events and batch items) and rpc (control results). The class is built in
layers by job: engine/api/client_core.py holds its state, the one control call path
(:meth:`call`), the RPC router and the engine's death, and this module the lifecycle, the
session and batch streams and the figures.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import janus
from opentelemetry.trace import Tracer

from duplex_contract.batch import BatchDone, BatchItem, BatchJob
from duplex_contract.errors import EngineDeadError, EngineError
from duplex_contract.events import SessionEvent, SessionLifecycle
from engine.api.client_core import _END, EngineClientCore
from engine.config import EngineConfig
from engine.messages import (
    AbortRequest,
    BatchOutput,
    GenerateRequest,
    ShutdownRequest,
)
from engine.orchestration.orchestrator import Orchestrator
from engine.orchestration.speculation import SpeculativeAsr
from engine.spans import EngineTracing
from engine.stage_figures import StageEngineFigures, stage_engine_figures
from engine.stages.base import StageBackend

log = logging.getLogger(__name__)


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
    # speculative responses (engine/orchestration/drafts.py) by outcome: started, used, dropped
    speculative_responses: dict[str, int] = field(default_factory=dict)
    # speculative transcripts of pauses (engine/orchestration/speculation.py): started, skipped,
    # used
    speculative_transcripts: dict[str, int] = field(default_factory=dict)
    # what the stages' own engines report (vLLM: running/waiting, KV cache use, tokens)
    stage_engines: dict[str, StageEngineFigures] = field(default_factory=dict)


def _guesses(spec: SpeculativeAsr | None) -> dict[str, int]:
    """Speculative transcripts of pauses by outcome (engine/orchestration/speculation.py)."""
    if spec is None:
        return {}
    return {
        "started": spec.started,
        "skipped": spec.skipped,
        "used": spec.used,
        "reguessed": spec.reguesses,
    }


class AsyncEngine(EngineClientCore):
    """Create with ``await AsyncEngine.start(config)``; see docs/engine.md."""

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
        (engine/spans.py); None: no spans."""
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
                name: sum(r.restarts for r in pool.replicas) for name, pool in orch.pools.items()
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
