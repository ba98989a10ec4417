"""The sessions' turns: one runner task per session with committed turns, each turn's
transcript and response (text and audio, or a function call), and a barge-in's cancel."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

from duplex_contract.errors import EngineError, StageError
from duplex_contract.events import (
    AudioChunk,
    ErrorInfo,
    FunctionCallDelta,
    ResponseDone,
    ResponseStarted,
    TextDelta,
    UserTranscript,
)
from duplex_contract.tools import ResponseOptions, ToolCall
from engine.duplex.effects import Cancel
from engine.duplex.fence import epoch_prefix
from engine.duplex.session import DuplexSession, TurnJob
from engine.messages import Priority
from engine.orchestration.drafts import Draft, ResponsePlan, plan_diff, response_plan
from engine.orchestration.orchestrator_core import OrchestratorCore, _Runner
from engine.orchestration.pipeline import LlmResult, SpokenChunk
from engine.orchestration.tool_calls import CallStream, finish_call
from engine.tasks import cancelling

log = logging.getLogger(__name__)


class OrchestratorTurns(OrchestratorCore):
    """Runs each session's turns, in order, on the orchestrator's loop."""

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
        if self.speculation is not None:  # the session's next words are a new utterance
            self.speculation.answered(sid)
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

    # ------------------------------------------------------------------ cancel
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
