"""The orchestrator: its own thread and event loop; start-up, dispatch, clean-up, reaper.

It owns the control plane (:class:`DuplexControl`), the stage pools and one runner task per
session with committed turns. No model code runs here: stage backends compute in their own
workers. Results go back on the rpc queue, session and batch outputs on the output queue.
Output whose fence is stale is dropped before routing. By job: the state and the output
routing in engine/orchestration/orchestrator_core.py, the sessions' turns in
engine/orchestration/orchestrator_turns.py,
the thread's lifecycle, the dispatch of requests and the clean-up here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from typing import Any

import janus

from duplex_contract.control import AppendCall, CloseCall, CommitCall, OpenCall, SignalCall
from duplex_contract.errors import EngineDeadError
from duplex_contract.events import ErrorInfo
from duplex_contract.languages import ENGLISH_ONLY
from engine import heap
from engine.duplex.effects import Effects
from engine.duplex.fence import session_prefix
from engine.messages import (
    AbortRequest,
    ControlRequest,
    DetachRequest,
    EngineFatal,
    EngineRequest,
    GenerateRequest,
    ShutdownRequest,
)
from engine.orchestration.batch_jobs import serve_batch
from engine.orchestration.draft_book import DraftBook
from engine.orchestration.graph import build_graph
from engine.orchestration.orchestrator_turns import OrchestratorTurns
from engine.orchestration.pipeline import Pipeline
from engine.orchestration.scheduling import make_scheduler
from engine.orchestration.speculation import SpeculativeAsr
from engine.stages.pool import StagePool
from engine.startup import start_pools

log = logging.getLogger(__name__)

_BATCH_MAX = 512


class Orchestrator(OrchestratorTurns):
    """The orchestrator's thread: it starts the stages, dispatches requests, cleans up
    closed sessions (the reaper) and runs batch jobs. Its state and shared helpers are
    :class:`engine.orchestration.orchestrator_core.OrchestratorCore`'s, the sessions' turns
    :class:`engine.orchestration.orchestrator_turns.OrchestratorTurns`'."""

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
        assert self.graph is not None
        self.scheduler = make_scheduler(self.config.scheduling, self.pools, self._turn_running)
        self.pipeline = Pipeline(self.config, self.graph, self.pools, self.scheduler)
        self.speculation = SpeculativeAsr(
            self.pipeline,
            self.config.input_sample_rate,
            self._track,
            self.route_of,
            self.language_of,
            self.stream_of,
        )
        self.drafts = DraftBook(
            self.config,
            self.pipeline,
            self.scheduler,
            self.speculation,
            self.control.sessions,
            self.counters,
            route_of=self.route_of,
            respond=self._draft_response,
            abort=self._abort,
            track=self._track,
        )
        try:
            self.started.set_result(self.request_q.sync_q)
        except concurrent.futures.InvalidStateError:  # the starter gave up while models loaded
            await self._close_stages()
            self.request_q.close()
            await self.request_q.wait_closed()
            return
        reaper = asyncio.create_task(self._reaper(), name="reaper")
        try:
            await self._serve(self.request_q.async_q)
        finally:
            reaper.cancel()
            await self._stop_everything()
            self.request_q.close()
            await self.request_q.wait_closed()

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
            from engine.orchestration.partials import PartialTranscriber

            self.partials = PartialTranscriber(
                self._partial_from_worker, max_streams=self.config.partials.max_streams
            )
            self.partials.start()

    async def _close_stages(self) -> None:
        if self.partials is not None:
            await asyncio.to_thread(self.partials.close)
        await asyncio.gather(*(p.close() for p in self.pools.values()), return_exceptions=True)

    async def _stop_everything(self) -> None:
        tasks: list[asyncio.Task[Any]] = [r.task for r in self._runners.values()]
        tasks += list(self._batch.values())
        if self.speculation is not None:
            tasks += self.speculation.tasks()
        tasks += list(self._tasks)
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
                    self._reply_raw(msg.control_id, sid, err)
                    continue
            kept.append(msg)
        return kept

    def _reply_raw(self, control_id: int, sid: str, err: ErrorInfo) -> None:
        from duplex_contract.control import ControlResult

        self._rpc.put_nowait(
            ControlResult(control_id=control_id, ok=False, session_id=sid, error=err)
        )

    def _dispatch(self, msg: EngineRequest) -> None:
        if isinstance(msg, ControlRequest):
            call = msg.call
            result, effects = self.control.handle(call, msg.control_id, time.monotonic())
            if isinstance(call, OpenCall) and result.ok and result.session_id is not None:
                self.tracing.session_opened(result.session_id, call.traceparent)
            self._rpc.put_nowait(result)
            # the work a commit or a pause starts (tasks copy the context) joins its turn
            tp = call.traceparent if isinstance(call, CommitCall | SignalCall) else None
            with self.tracing.turn(tp):
                self._apply(effects)
        elif isinstance(msg, GenerateRequest):
            assert self.pipeline is not None
            task = asyncio.create_task(self._run_batch(msg), name=f"batch:{msg.request_id}")
            self._batch[msg.request_id] = task
        elif isinstance(msg, AbortRequest):
            running = self._batch.get(msg.request_id)
            if running is not None:
                running.cancel()
        elif isinstance(msg, DetachRequest):
            now = time.monotonic()
            for sid in msg.session_ids:
                self.control.detach(sid, now)

    def _apply(self, effects: Effects) -> None:
        for cancel in effects.cancels:
            self._cancel(cancel)
        if self.drafts is not None:
            self.drafts.on_effects(effects)
        if self.partials is not None:
            for sid in effects.input_reset:
                self._partial_gen[sid] = self._partial_gen.get(sid, 0) + 1
                self.partials.reset(sid)
            for sid, pcm in effects.heard:
                if self.language_of(sid) in ENGLISH_ONLY:  # pocketsphinx's model is en-us
                    self.partials.feed(sid, self._partial_gen.get(sid, 0), pcm)
        for sid in effects.start:
            self._ensure_runner(sid)
        for out in effects.events:
            self._out.put_nowait(out)
        for sid in effects.cleanups:
            if sid not in self._cleaning:
                self._cleaning.add(sid)
                self._spawn(self._cleanup(sid), f"cleanup:{sid}")

    # ------------------------------------------------------------------ clean-up
    async def _cleanup(self, sid: str) -> None:
        """Abort everything of a closing session; free its slot only once that succeeded."""
        try:
            self._drop_draft(sid)
            self._abort(sid, session_prefix(sid))
            runner = self._runners.pop(sid, None)
            if runner is not None:
                runner.task.cancel()
                await asyncio.gather(runner.task, return_exceptions=True)
            plans = list(self._plans.get(sid, ()))
            try:
                await asyncio.wait_for(
                    asyncio.gather(*(self._run_plan(p) for p in plans)),
                    self.config.duplex.cleanup_timeout_s,
                )
            except TimeoutError:
                log.warning("cleanup of %s: stage aborts did not finish; the reaper retries", sid)
                return
            self._plans.pop(sid, None)
            if self.speculation is not None:
                self.speculation.drop(sid)
            for pool in self.pools.values():
                pool.release_session(sid)
            self.tracing.session_closed(sid)
            if self.partials is not None:
                self.partials.drop(sid)
                self._partial_gen.pop(sid, None)
            self._apply(self.control.finish_close(sid))
        except Exception:
            log.exception("cleanup of %s failed; the reaper retries it", sid)
        finally:
            self._cleaning.discard(sid)

    async def _reaper(self) -> None:
        interval = self.config.duplex.reaper_interval_s
        trim_every = self.config.duplex.heap_trim_interval_s
        next_trim = time.monotonic() + trim_every
        while True:
            await asyncio.sleep(interval)
            try:
                now = time.monotonic()
                self._apply(self.control.tick(now, self._cleaning))
                self.counters.session_bytes = self._session_bytes()
                if trim_every > 0 and now >= next_trim and heap.can_trim():
                    next_trim = now + trim_every
                    await asyncio.to_thread(heap.trim_heap)  # ~ms; off the loop
                    self.counters.heap_trims += 1
            except Exception:
                log.exception("reaper tick failed")

    def _session_bytes(self) -> dict[str, int]:
        """What the engine holds for its sessions, by part (docs/protocol.md §8)."""
        pending = history = 0
        for session in self.control.sessions.values():
            pending += session.input_bytes()
            history += session.history.nbytes
        spec = self.speculation.nbytes if self.speculation is not None else 0
        draft = self.drafts.held_bytes if self.drafts is not None else 0
        return {"engine_input": pending, "history": history, "speculation": spec, "draft": draft}

    # ------------------------------------------------------------------ batch
    async def _run_batch(self, msg: GenerateRequest) -> None:
        assert self.pipeline is not None
        try:
            await serve_batch(
                self.pipeline, msg, self._out.put_nowait, lambda p: self._run_plan(self._plan(p))
            )
        finally:
            self._batch.pop(msg.request_id, None)
