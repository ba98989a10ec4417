"""The orchestrator: its own thread and event loop; dispatch, output routing, reaper.

It owns the control plane (:class:`DuplexControl`), the stage pools and one runner task per
session with committed turns. No model code runs here: stage backends compute in their own
workers. Results go back on the rpc queue, session and batch outputs on the output queue.
Output whose fence is stale is dropped here, before routing.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import janus

from duplex_contract.control import AppendCall, CloseCall, CommitCall, OpenCall, SignalCall
from duplex_contract.errors import EngineDeadError, EngineError, StageError
from duplex_contract.events import (
    AudioChunk,
    ErrorInfo,
    FunctionCallDelta,
    ResponseDone,
    ResponseStarted,
    SessionEvent,
    TextDelta,
    UserTranscript,
)
from duplex_contract.languages import DEFAULT_LANGUAGE, ENGLISH_ONLY
from duplex_contract.tools import ResponseOptions, ToolCall
from engine import heap
from engine.batch_jobs import serve_batch
from engine.config import EngineConfig
from engine.counters import Counters
from engine.draft_book import DraftBook
from engine.drafts import Draft, ResponsePlan, plan_diff, response_plan
from engine.duplex.control import Cancel, DuplexControl, Effects
from engine.duplex.fence import epoch_prefix, session_prefix
from engine.duplex.session import DuplexSession, TurnJob
from engine.graph import Graph, build_graph
from engine.messages import (
    AbortRequest,
    ControlRequest,
    DetachRequest,
    EngineFatal,
    EngineOutput,
    EngineRequest,
    GenerateRequest,
    Priority,
    SessionOutput,
    ShutdownRequest,
)
from engine.pipeline import LlmResult, Pipeline, SpokenChunk
from engine.scheduling import Scheduler, make_scheduler
from engine.speculation import SpeculativeAsr
from engine.stages.base import StageBackend, StagePool
from engine.startup import start_pools
from engine.tasks import cancelling, reap
from engine.tool_calls import CallStream, finish_call
from engine.tracing import EngineTracing

if TYPE_CHECKING:
    from engine.partials import PartialTranscriber

log = logging.getLogger(__name__)
_BATCH_MAX = 512
AbortPlan = list[tuple[StagePool, list[tuple[int, list[str]]]]]


@dataclass
class _Runner:
    task: asyncio.Task[None]
    job: TurnJob | None = None
    started: bool = False  # ResponseStarted was emitted for ``job``


class Orchestrator:
    def __init__(
        self,
        config: EngineConfig,
        out_q: janus.SyncQueue[EngineOutput],
        rpc_q: janus.SyncQueue[Any],
        backends: Mapping[str, Sequence[StageBackend]] | None = None,
        tracing: EngineTracing | None = None,
    ) -> None:
        self.config = config
        self.tracing = tracing or EngineTracing()
        # One put per item: batching per loop iteration was measured to raise the per-chunk
        # latency (p50 0.38 -> 0.55 ms at 32 sessions) without raising server capacity.
        self._out = out_q
        self._rpc = rpc_q
        self._backends = backends
        self.control = DuplexControl(config.duplex, config.default_instructions)
        self.counters = Counters()
        self.scheduler: Scheduler | None = None  # engine/scheduling.py, once stages run
        self.drafts: DraftBook | None = None  # guesses and drafts (engine/draft_book.py)
        self.pools: dict[str, StagePool] = {}
        self._runners: dict[str, _Runner] = {}
        self._batch: dict[str, asyncio.Task[None]] = {}
        self._cleaning: set[str] = set()
        self._plans: dict[str, list[AbortPlan]] = {}
        self.speculation: SpeculativeAsr | None = None
        self.partials: PartialTranscriber | None = None
        self._partial_gen: dict[str, int] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self.request_q: janus.Queue[EngineRequest] | None = None
        self.started: concurrent.futures.Future[janus.SyncQueue[EngineRequest]] = (
            concurrent.futures.Future()
        )
        self.loop: asyncio.AbstractEventLoop | None = None
        self.pipeline: Pipeline | None = None
        self.graph: Graph | None = None

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
            from engine.partials import PartialTranscriber

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

    def _spawn(self, coro: Any, name: str) -> None:
        self._track(asyncio.create_task(coro, name=name))

    def _track(self, task: asyncio.Task[Any]) -> None:
        """Keep a task that nobody awaits; shutdown cancels and awaits it."""
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(reap)

    # ------------------------------------------------------------------ output
    def emit(self, sid: str, event: SessionEvent, *, final: bool = False) -> None:
        """Route one session event; stale-fence output is dropped (a final done is not)."""
        fence = getattr(event, "fence", None)
        if fence is not None and not final and not self.control.is_current(fence):
            self.counters.stale_dropped += 1
            return
        self._out.put_nowait(SessionOutput(session_id=sid, event=event))

    def stages_down(self) -> dict[str, str]:
        """Stages with a replica that reports itself down (``health()``), and why."""
        down: dict[str, str] = {}
        for name, pool in self.pools.items():
            for replica in pool.replicas:
                health = getattr(replica, "health", None)
                why = health() if health is not None else None
                if why:
                    down[name] = why
        return down

    def route_of(self, sid: str) -> str:
        """A session's route: ``voice`` when its output includes audio, else ``text``."""
        session = self.control.sessions.get(sid)
        if session is not None and "audio" not in session.config.output_modalities:
            return "text"
        return "voice"

    def stream_of(self, sid: str) -> float | None:
        """Where a session's uncommitted audio starts on its input clock, if known."""
        session = self.control.sessions.get(sid)
        return None if session is None else session.audio_stream_ms

    def language_of(self, sid: str) -> str:
        """The language a session's speech is transcribed in (``en`` unless it set one)."""
        session = self.control.sessions.get(sid)
        return DEFAULT_LANGUAGE if session is None else session.config.language

    # ------------------------------------------------------------------ session runners
    def _ensure_runner(self, sid: str) -> None:
        runner = self._runners.get(sid)
        if runner is not None and not runner.task.done():
            return
        task = asyncio.create_task(self._run_session(sid), name=f"runner:{sid}")
        self._runners[sid] = _Runner(task=task)

    async def _run_session(self, sid: str) -> None:
        runner = self._runners[sid]
        while (job := self.control.next_job(sid)) is not None:
            runner.job, runner.started = job, False
            session = self.control.sessions[sid]
            self._drafts_of().drop_others(sid)  # (as the scheduling policy says)
            if job.respond:  # batch work waits until this turn's first output is out
                self._sched().enter_critical(job.fence.key())
            try:
                with self.tracing.turn(job.traceparent):
                    await self._run_turn(session, job, runner)
            except asyncio.CancelledError:
                if cancelling():
                    raise  # this runner was cancelled (barge-in, close, shutdown)
                # something the turn awaited was cancelled, not the runner: fail the turn
                # and go on, never leave the session's job unfinished
                self._fail_turn(sid, job, runner, StageError("a stage request was cancelled"))
            except EngineError as exc:
                self._fail_turn(sid, job, runner, exc)
            except Exception as exc:
                log.exception("turn %s failed", job.fence.key())
                self._fail_turn(sid, job, runner, StageError(f"internal error: {exc!r}"))
            finally:
                self._sched().leave_critical(job.fence.key())
                if runner.job is job:
                    runner.job = None
                self._drop_draft(sid)  # one the turn did not adopt
            self.control.job_done(sid, job, time.monotonic())

    def _fail_turn(self, sid: str, job: TurnJob, runner: _Runner, exc: EngineError) -> None:
        if not job.respond:
            return
        if not runner.started:
            self.emit(sid, ResponseStarted(fence=job.fence))
            runner.started = True
        info = ErrorInfo.from_exc(exc, session_id=sid, request_id=job.fence.key())
        self.emit(sid, ResponseDone(fence=job.fence, status="failed", reason=exc.code, error=info))

    async def _run_turn(self, session: DuplexSession, job: TurnJob, runner: _Runner) -> None:
        assert self.pipeline is not None
        sid, fence = session.session_id, job.fence
        history = session.history
        text = job.text
        heard = ""
        t_job = time.perf_counter()
        marks: dict[str, float] = {}
        if job.audio:
            assert self.speculation is not None
            heard = await self.speculation.transcript(fence, job.audio, job.stream_ms)
            marks["asr_wait"] = (time.perf_counter() - t_job) * 1000
            self.emit(sid, UserTranscript(fence=fence, text=heard, final=True))
            text = f"{text} {heard}".strip()
        for item_id, part in job.items:
            if part.strip():
                history.add_user(part, fence.turn_id, item_id)
        for output in job.tool_outputs:
            history.add_tool_output(output, fence.turn_id)
        if heard and not job.audio_deleted:
            history.add_user(heard, fence.turn_id, job.audio_item)
        job.heard = True
        if not job.respond:
            return
        runner.started = True
        self.emit(sid, ResponseStarted(fence=fence))
        if job.audio and not text:
            self.emit(sid, ResponseDone(fence=fence, status="incomplete", reason="no_speech"))
            return
        await self._respond(session, job, marks)

    async def _respond(
        self, session: DuplexSession, job: TurnJob, marks: dict[str, float] | None = None
    ) -> None:
        """The response of ``job``: text and audio, or one function call. ``marks``
        collects the engine's timeline (ms: asr_wait, llm_first_token, tts_first_audio)."""
        assert self.pipeline is not None
        marks = {} if marks is None else marks
        sid, fence = session.session_id, job.fence
        prefix = fence.key()
        opts = job.response or ResponseOptions()
        history = session.history
        record = opts.conversation != "none"  # out of band: the history is not written
        turn, resp = fence.turn_id, fence.response_seq
        plan = response_plan(self.config, session, opts)
        want_text = "text" in (opts.output_modalities or session.config.output_modalities)
        want_audio = plan.route == "voice"
        draft = self._drafts_of().pop(sid)
        if draft is not None and (draft.plan is None or draft.plan != plan):
            if log.isEnabledFor(logging.INFO):
                why = "not started" if draft.plan is None else plan_diff(draft.plan, plan)
                log.info("speculative response for %s not used: %s", prefix, why)
            self._drafts_of().discard(draft)  # not started yet, or it answers something else
            draft = None
        if record:
            history.start_assistant(turn, resp)
        calls = CallStream()
        call_id = f"call_{secrets.token_hex(12)}"

        t_llm = time.perf_counter()

        def on_text(delta: str) -> None:
            if "llm_first_token" not in marks:
                marks["llm_first_token"] = (time.perf_counter() - t_llm) * 1000
            if not want_audio:
                self._sched().leave_critical(prefix)
            if want_text:
                self.emit(sid, TextDelta(fence=fence, text=delta))
            if not want_audio and record:
                history.append_assistant_text(turn, resp, delta)

        def on_call(piece: str) -> None:
            self._sched().leave_critical(prefix)
            delta = calls.push(piece)
            if delta:
                self.emit(
                    sid,
                    FunctionCallDelta(
                        fence=fence, call_id=call_id, name=calls.name or "", delta=delta
                    ),
                )

        def on_chunk(chunk: SpokenChunk) -> None:
            if "tts_first_audio" not in marks:
                first = marks.get("llm_first_token", 0.0)
                marks["tts_first_audio"] = (time.perf_counter() - t_llm) * 1000 - first
            self._sched().leave_critical(prefix)
            if record:
                history.append_assistant(
                    turn, resp, chunk.mark, chunk.audio_start_ms, chunk.duration_ms
                )
            self.emit(
                sid,
                AudioChunk(
                    fence=fence,
                    pcm=chunk.out.pcm,
                    sample_rate=chunk.out.sample_rate,
                    audio_start_ms=chunk.audio_start_ms,
                    duration_ms=chunk.duration_ms,
                    text=chunk.mark,
                    t_stage_ns=chunk.out.t_ns,
                ),
            )

        if draft is not None:
            assert draft.task is not None
            marks["speculative_ms"] = (t_llm - draft.created) * 1000  # how far ahead it began
            self.counters.drafts["used"] += 1
            draft.adopt(on_text, on_chunk, on_call)
            try:
                drafted = await draft.task
            except asyncio.CancelledError:
                draft.task.cancel()
                raise
            finally:
                # a failed draft task keeps its error, whose traceback holds the draft's
                # frame and so the draft: draft -> task -> error -> frame -> draft
                draft.task = None
            if drafted is None:  # cannot happen once it has a plan; be loud if it does
                raise StageError("the speculative response ended without a result")
            result = drafted
        else:
            result = await self._start_response(
                prefix, sid, plan, on_text=on_text, on_chunk=on_chunk, on_call=on_call
            )
        length = result.finish_reason == "length"
        if result.call:

            def keep(call: ToolCall) -> None:
                if record:
                    history.set_tool_call(fence.turn_id, fence.response_seq, call)

            finish_call(calls, call_id, plan.tools, fence, lambda e: self.emit(sid, e), keep)
            if record:
                history.finish_assistant(turn, resp, "completed")
            if length:
                raise StageError(
                    "the function call was cut at max_output_tokens", code="invalid_tool_call"
                )
        elif record:
            history.finish_assistant(turn, resp, "completed")
        self.emit(
            sid,
            ResponseDone(
                fence=fence,
                status="incomplete" if length else "completed",
                reason="max_output_tokens" if length else None,
                text=result.text,
                audio_ms=result.audio_ms,
                output_tokens=result.tokens,
                input_tokens=result.prompt_tokens,
                timing_ms={k: round(v, 1) for k, v in marks.items()},
            ),
        )

    async def _start_response(
        self,
        prefix: str,
        sid: str,
        plan: ResponsePlan,
        *,
        on_text: Callable[[str], None],
        on_chunk: Callable[[SpokenChunk], None],
        on_call: Callable[[str], None],
    ) -> LlmResult:
        assert self.pipeline is not None
        return await self.pipeline.respond(
            prefix,
            plan.messages,
            route=plan.route,
            max_tokens=plan.max_tokens,
            temperature=plan.temperature,
            voice=plan.voice,
            sample_rate=plan.sample_rate,
            session_id=sid,
            priority=Priority.REALTIME,
            on_text=on_text,
            on_chunk=on_chunk,
            tools=plan.tools,
            tool_required=plan.tool_required,
            on_call=on_call,
        )

    # ------------------------------------------------------------------ speculative responses
    def _draft_response(self, prefix: str, sid: str, plan: ResponsePlan, draft: Draft) -> Any:
        """A draft's response: the turn's own request, its outputs held by the draft."""
        return self._start_response(
            prefix, sid, plan, on_text=draft.on_text, on_chunk=draft.on_chunk, on_call=draft.on_call
        )

    def _turn_running(self, besides: str) -> bool:
        """A real turn runs in a session other than ``besides``."""
        return any(r.job is not None for s, r in self._runners.items() if s != besides)

    @property
    def _drafts(self) -> dict[str, Draft]:
        """Each session's draft (engine/draft_book.py)."""
        return self.drafts.drafts if self.drafts is not None else {}

    def _drafts_of(self) -> DraftBook:
        assert self.drafts is not None
        return self.drafts

    def _sched(self) -> Scheduler:
        assert self.scheduler is not None
        return self.scheduler

    @property
    def admission(self) -> Any:
        """Batch admission figures (``waits``, ``critical``) of the scheduling policy."""
        return getattr(self.scheduler, "admission", self.scheduler)

    def _drop_draft(self, sid: str) -> None:
        if self.drafts is not None:
            self.drafts.drop(sid)

    # ------------------------------------------------------------------ live partials
    def _partial_from_worker(self, sid: str, generation: int, text: str) -> None:
        assert self.loop is not None
        try:
            self.loop.call_soon_threadsafe(self._emit_partial, sid, generation, text)
        except RuntimeError:
            pass  # shutting down

    def _emit_partial(self, sid: str, generation: int, text: str) -> None:
        if self._partial_gen.get(sid, 0) != generation:
            return  # a partial of input that was already committed or cleared
        session = self.control.sessions.get(sid)
        if session is not None and session.state == "open":
            self.emit(sid, UserTranscript(fence=session.fence, text=text, final=False))

    def _cancel(self, cancel: Cancel) -> None:
        sid = cancel.session_id
        self._drop_draft(sid)
        runner = self._runners.get(sid)
        prefix = epoch_prefix(sid, cancel.old_epoch)
        if (
            runner is not None
            and runner.job is not None
            and runner.job.fence.epoch == cancel.old_epoch
        ):
            job, started = runner.job, runner.started
            runner.task.cancel()
            self._track(runner.task)
            del self._runners[sid]
            if job.respond and started:
                session = self.control.sessions.get(sid)
                if session is not None:
                    session.history.finish_assistant(
                        job.fence.turn_id, job.fence.response_seq, "cancelled"
                    )
                self.emit(
                    sid,
                    ResponseDone(fence=job.fence, status="cancelled", reason=cancel.reason),
                    final=True,
                )
        self._abort(sid, prefix)

    def _plan(self, prefix: str) -> AbortPlan:
        """The running stage requests under ``prefix``, located now (before tasks unwind)."""
        return [(pool, pool.locate_prefix(prefix)) for pool in self.pools.values()]

    @staticmethod
    async def _run_plan(plan: AbortPlan) -> None:
        await asyncio.gather(*(pool.abort_located(located) for pool, located in plan if located))

    def _abort(self, sid: str, prefix: str) -> None:
        """Abort a fence's stage requests; until done, the plan stays with the session."""
        plan = self._plan(prefix)
        if not any(located for _, located in plan):
            return
        plans = self._plans.setdefault(sid, [])
        plans.append(plan)

        async def run() -> None:
            await self._run_plan(plan)
            if plan in plans:
                plans.remove(plan)

        self._spawn(run(), f"abort:{prefix}")

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
