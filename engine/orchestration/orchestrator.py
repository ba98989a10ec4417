"""The orchestrator: its own thread and event loop; start-up, shutdown, and the dispatch of
requests and control-plane effects to the parts it holds.

It owns the control plane (:class:`DuplexControl`) and the stage pools, and holds one part
per job: the output router (engine/orchestration/output_router.py: stale fences dropped),
the turn runner (turn_runner.py: one runner task per session with committed turns; the
response in responder.py), the stage aborts of a fence (stage_aborts.py), the draft book
(draft_book.py) and the speculative transcripts (speculation.py), the scheduling policy
(scheduling.py), live partials (live_partials.py), a closing session's clean-up
(session_cleanup.py), the reaper (reaper.py) and the batch jobs (batch_jobs.py). No model
code runs here: stage backends compute in their own workers. Results go back on the rpc
queue, session and batch outputs on the output queue.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import sqlite3
import time
from collections.abc import Mapping, Sequence
from typing import Any

import janus
import msgspec

from duplex_contract.control import (
    AppendCall,
    CloseCall,
    CommitCall,
    ControlResult,
    OpenCall,
    SignalCall,
)
from duplex_contract.errors import EngineDeadError
from duplex_contract.session_events import ErrorInfo
from engine.config import EngineConfig
from engine.duplex.control_plane import DuplexControl
from engine.duplex.effects import Effects
from engine.duplex.store import SessionStore
from engine.messages import (
    AbortRequest,
    ControlRequest,
    DetachRequest,
    EngineFatal,
    EngineOutput,
    EngineRequest,
    GenerateRequest,
    ShutdownRequest,
)
from engine.orchestration.admission import BatchAdmission
from engine.orchestration.background import BackgroundTasks
from engine.orchestration.batch_jobs import BatchJobs
from engine.orchestration.capacity import CapacityAdmission, CapacityScheduler
from engine.orchestration.counters import Counters
from engine.orchestration.draft_book import DraftBook
from engine.orchestration.live_partials import LivePartials, OnPartial, PartialFeed
from engine.orchestration.output_router import OutputBatch, OutputRouter
from engine.orchestration.policies import make_scheduler
from engine.orchestration.reaper import Reaper
from engine.orchestration.responder import Responder
from engine.orchestration.scheduling import Scheduler, SerialScheduler
from engine.orchestration.session_cleanup import SessionCleanup
from engine.orchestration.session_facts import SessionFacts
from engine.orchestration.speculation import SpeculativeAsr
from engine.orchestration.stage_aborts import StageAborts
from engine.orchestration.turn_runner import Runners, TurnRunner
from engine.pipeline.graph import Graph, build_graph
from engine.pipeline.pipeline import Pipeline
from engine.spans import EngineTracing
from engine.stage_figures import SchedulingFigures
from engine.stages.base import StageBackend
from engine.stages.pool import StagePool
from engine.startup import start_pools

log = logging.getLogger(__name__)

_BATCH_MAX = 512


class Orchestrator:
    """The orchestrator's thread: it starts the stages, builds its parts, dispatches
    requests to them and stops everything at shutdown. ``run()`` is the thread's entry;
    ``started`` resolves to the request queue once every stage has loaded."""

    def __init__(
        self,
        config: EngineConfig,
        out_q: janus.SyncQueue[EngineOutput | list[EngineOutput]],
        rpc_q: janus.SyncQueue[Any],
        backends: Mapping[str, Sequence[StageBackend]] | None = None,
        tracing: EngineTracing | None = None,
    ) -> None:
        self.config = config
        self.tracing = tracing or EngineTracing()
        self._out = out_q
        self._rpc = rpc_q
        self._backends = backends
        self.control = DuplexControl(config.duplex, config.default_instructions)
        self.counters = Counters()
        self.pools: dict[str, StagePool] = {}
        self._batch = OutputBatch(out_q.put_nowait)
        self.output = OutputRouter(self._batch, self.control.is_current, self.counters)
        self.background = BackgroundTasks()
        self.aborts = StageAborts(self.pools, self.background.spawn)
        self.runners = Runners()
        self.facts = SessionFacts(self.control.sessions)
        self.started: concurrent.futures.Future[janus.SyncQueue[EngineRequest]] = (
            concurrent.futures.Future()
        )
        self.loop: asyncio.AbstractEventLoop | None = None
        self.request_q: janus.Queue[EngineRequest] | None = None
        # built on the loop, once the stages run (_start_stages, _build)
        self.graph: Graph | None = None
        self.partials: LivePartials | None = None
        self.scheduler: Scheduler | None = None  # engine/orchestration/scheduling.py
        self.pipeline: Pipeline | None = None
        self.speculation: SpeculativeAsr | None = None
        self.drafts: DraftBook | None = None  # guesses and drafts (draft_book.py)
        self.turns: TurnRunner | None = None
        self.cleanup: SessionCleanup | None = None
        self.reaper: Reaper | None = None
        self.batches: BatchJobs | None = None
        self.store: SessionStore | None = None  # engine.duplex.store_path (docs/scale.md)

    # ------------------------------------------------------------------ figures
    def stages_down(self) -> dict[str, str]:
        """Stages with no live replica (every replica reports itself down: ``health()``), and
        why (the first replica's reason)."""
        down: dict[str, str] = {}
        for name, pool in self.pools.items():
            if not pool.live():
                down[name] = pool.down(0) or "down"
        return down

    def replicas_down(self) -> dict[str, str]:
        """Replicas that report themselves down while their stage still has a live one
        (``/health`` answers 200 ``degraded`` naming them), and why."""
        out: dict[str, str] = {}
        for pool in self.pools.values():
            live = pool.live()
            if not live:
                continue
            for i, replica in enumerate(pool.replicas):
                why = pool.down(i) if i not in live else None
                if why:
                    out[replica.name] = why
        return out

    def scheduling_figures(self) -> dict[str, SchedulingFigures]:
        """The scheduling policy's state per stage (``/metrics``)."""
        return self.scheduler.figures() if self.scheduler is not None else {}

    @property
    def admission(self) -> BatchAdmission | CapacityAdmission | None:
        """Batch admission figures (``waits``, ``critical``) of the scheduling policy."""
        scheduler = self.scheduler
        if isinstance(scheduler, SerialScheduler | CapacityScheduler):
            return scheduler.admission
        return None

    # ------------------------------------------------------------------ thread main
    def run(self) -> None:
        """Thread entry point."""
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # the engine is dead: tell everyone, then exit the thread
            log.exception("orchestrator died")
            self._fatal(f"orchestrator died: {exc!r}")
            if not self.started.done():
                self.started.set_exception(exc)

    def _fatal(self, message: str) -> None:
        info = ErrorInfo.from_exc(EngineDeadError(message))
        try:
            self._batch.flush()  # what was emitted before the death is read before it
            self._out.put_nowait(EngineFatal(error=info))
            self._rpc.put_nowait(EngineFatal(error=info))
        except RuntimeError:
            log.error("could not publish fatal error: %s", message)

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.request_q = janus.Queue()
        try:
            await self._start_stages()
        except BaseException as exc:
            await self._close_stages()
            self.request_q.close()
            await self.request_q.wait_closed()
            if not self.started.done():
                self.started.set_exception(exc)
            return
        reaper = self._build()
        self._restore()
        try:
            self.started.set_result(self.request_q.sync_q)
        except concurrent.futures.InvalidStateError:  # the starter gave up while models loaded
            await self._close_stages()
            self.request_q.close()
            await self.request_q.wait_closed()
            return
        reaping = asyncio.create_task(reaper.run(), name="reaper")
        try:
            await self._serve(self.request_q.async_q)
        finally:
            reaping.cancel()
            await self._stop_everything()
            self._batch.flush()  # the last outputs, put before the loop ends
            self.request_q.close()
            await self.request_q.wait_closed()
            if self.store is not None:
                self.store.close()

    def _restore(self) -> None:
        """Open the session store (if configured) and take its sessions back."""
        path = self.config.duplex.store_path
        if path is None:
            return
        self.store = SessionStore(path)
        kept = self.store.load()
        self._apply(self.control.restore(kept, time.monotonic()))
        log.info("session store %s: %d session(s) taken back", path, len(kept))

    async def _start_stages(self) -> None:
        """Build the stage graph (validated before any model loads), then start the
        replicas: one at a time per GPU, within ``start_timeout_s`` (engine/startup.py)."""
        self.graph = build_graph(self.config, self._backends)
        c = self.counters
        for name, replicas in self.graph.replicas.items():
            self.pools[name] = StagePool(
                name,
                replicas,
                c.latency,
                c.step,
                tracing=self.tracing,
                on_wait=c.wait,
                on_decode=c.decode,
            )
        await start_pools(self.pools, self.config.start_timeout_s)
        if self.config.partials.backend == "pocketsphinx":
            assert self.loop is not None
            self.partials = LivePartials(
                self._open_pocketsphinx,
                self.loop,
                self.control.sessions,
                self.output.emit,
                self.facts.language_of,
            )

    def _open_pocketsphinx(self, on_partial: OnPartial) -> PartialFeed:
        from engine.orchestration.partials import PartialTranscriber

        transcriber = PartialTranscriber(on_partial, max_streams=self.config.partials.max_streams)
        transcriber.start()
        return transcriber

    def _build(self) -> Reaper:
        """The parts that work on the running stages; returns the reaper to run."""
        assert self.graph is not None
        config, facts, output = self.config, self.facts, self.output
        scheduler = make_scheduler(config.scheduling, self.pools, self.runners.turn_running)
        pipeline = Pipeline(config, self.graph, self.pools, scheduler)
        speculation = SpeculativeAsr(
            pipeline,
            config.input_sample_rate,
            self.background.track,
            facts.route_of,
            facts.language_of,
            facts.stream_of,
        )
        drafts = DraftBook(
            config,
            pipeline,
            scheduler,
            speculation,
            self.control.sessions,
            self.counters,
            route_of=facts.route_of,
            abort=self.aborts.abort,
            track=self.background.track,
            emit=output.emit,
        )
        responder = Responder(
            config,
            pipeline,
            drafts,
            speculation,
            self.counters,
            emit=output.emit,
            leave_critical=scheduler.leave_critical,
        )
        turns = TurnRunner(
            self.runners,
            self.control,
            responder,
            drafts,
            scheduler,
            speculation,
            self.tracing,
            emit=output.emit,
            abort=self.aborts.abort,
            track=self.background.track,
            keep=self._keep_conversation,
        )
        cleanup = SessionCleanup(
            config.duplex.cleanup_timeout_s,
            drafts,
            self.aborts,
            turns,
            speculation,
            self.pools,
            self.tracing,
            self.partials,
            finish=self._finish_close,
            spawn=self.background.spawn,
        )
        reaper = Reaper(
            config.duplex,
            self.control,
            self.counters,
            speculation,
            drafts,
            cleaning=cleanup.cleaning,
            apply=self._apply,
        )
        self.scheduler = scheduler
        self.pipeline = pipeline
        self.speculation = speculation
        self.drafts = drafts
        self.turns = turns
        self.cleanup = cleanup
        self.reaper = reaper
        self.batches = BatchJobs(pipeline, output.put, self.aborts.abort_now)
        return reaper

    async def _close_stages(self) -> None:
        if self.partials is not None:
            await asyncio.to_thread(self.partials.close)
        await asyncio.gather(*(p.close() for p in self.pools.values()), return_exceptions=True)

    async def _stop_everything(self) -> None:
        tasks: list[asyncio.Task[Any]] = list(self.runners.tasks())
        if self.batches is not None:
            tasks += self.batches.tasks()
        if self.speculation is not None:
            tasks += self.speculation.tasks()
        tasks += self.background.tasks()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._close_stages()

    # ------------------------------------------------------------------ dispatch
    async def _serve(self, q: janus.AsyncQueue[EngineRequest]) -> None:
        while True:
            batch = [await q.get()]
            while len(batch) < _BATCH_MAX:
                try:
                    batch.append(q.get_nowait())
                except asyncio.QueueEmpty:
                    break
            for msg in self._preempt(batch):
                if isinstance(msg, ShutdownRequest):
                    return
                self._dispatch(msg)

    def _preempt(self, batch: list[EngineRequest]) -> list[EngineRequest]:
        """A close or input.cancel answers the queued appends it covers without applying them."""
        if len(batch) < 2:
            return batch
        cover: dict[str, int] = {}
        for i, msg in enumerate(batch):
            if isinstance(msg, ControlRequest):
                call = msg.call
                if isinstance(call, CloseCall) or (
                    isinstance(call, SignalCall) and call.event == "input.cancel"
                ):
                    cover[call.fence.session_id] = i
        if not cover:
            return batch
        kept: list[EngineRequest] = []
        for i, msg in enumerate(batch):
            if isinstance(msg, ControlRequest) and isinstance(msg.call, AppendCall):
                sid = msg.call.fence.session_id
                if cover.get(sid, -1) > i:
                    err = ErrorInfo(
                        kind="control",
                        code="stale_fence",
                        session_id=sid,
                        message="append pre-empted by a later cancel/close of its input",
                    )
                    self._batch.flush()
                    self._rpc.put_nowait(
                        ControlResult(
                            control_id=msg.control_id, ok=False, session_id=sid, error=err
                        )
                    )
                    continue
            kept.append(msg)
        return kept

    def _dispatch(self, msg: EngineRequest) -> None:
        if isinstance(msg, ControlRequest):
            call = msg.call
            now = time.monotonic()
            result, effects = self.control.handle(call, msg.control_id, now)
            if (effects.save or effects.items) and not self._save(effects, now):
                result = msgspec.structs.replace(result, saved=False)
            if isinstance(call, OpenCall) and result.ok and result.session_id is not None:
                self.tracing.session_opened(result.session_id, call.traceparent)
            self._batch.flush()
            self._rpc.put_nowait(result)
            # the work a commit or a pause starts (tasks copy the context) joins its turn
            tp = call.traceparent if isinstance(call, CommitCall | SignalCall) else None
            with self.tracing.turn(tp):
                self._apply(effects)
        elif isinstance(msg, GenerateRequest):
            assert self.batches is not None
            self.batches.start(msg)
        elif isinstance(msg, AbortRequest):
            assert self.batches is not None
            self.batches.cancel(msg.request_id)
        elif isinstance(msg, DetachRequest):
            now = time.monotonic()
            for sid in msg.session_ids:
                self.control.detach(sid, now)

    def _apply(self, effects: Effects) -> None:
        """Carry out the control plane's effects, in this order."""
        turns, drafts, cleanup = self.turns, self.drafts, self.cleanup
        assert turns is not None and drafts is not None and cleanup is not None
        for cancel in effects.cancels:
            turns.cancel(cancel)
        drafts.on_effects(effects)
        if self.partials is not None:
            self.partials.on_effects(effects)
        for sid in effects.start:
            turns.ensure(sid)
        for out in effects.events:
            self.output.put(out)
        for sid in effects.cleanups:
            cleanup.start(sid)

    def _finish_close(self, sid: str) -> None:
        """A session's clean-up is done: the control plane frees it."""
        self._apply(self.control.finish_close(sid))
        if self.store is not None:
            try:
                self.store.forget(sid)
            except sqlite3.Error:
                log.exception("session store: %s not forgotten", sid)

    # ------------------------------------------------------------------ the session store
    def _save(self, effects: Effects, now: float) -> bool:
        """Keep what a call changed (before its answer goes out): the sessions whole, or
        item records; False if the store failed (the answer then does not say ``saved``)."""
        if self.store is None:
            return False
        try:
            for sid in effects.save:
                session = self.control.sessions.get(sid)
                if session is not None:
                    self.store.save(session, now)
            for changes in effects.items:
                self.store.save_items(changes)
        except sqlite3.Error:
            log.exception("session store: a call's changes not saved")
            return False
        return True

    def _keep_conversation(self, sid: str) -> None:
        """A turn moved on (the user's words heard, a response ended): keep the history."""
        session = self.control.sessions.get(sid)
        if self.store is None or session is None or session.state != "open":
            return
        try:
            self.store.save_conversation(session)
        except sqlite3.Error:
            log.exception("session store: %s's conversation not saved", sid)
