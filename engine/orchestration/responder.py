"""The response of a committed turn: text and audio, or one function call, streamed to its
session as it is generated (or adopted from the draft that answered the turn's pause ahead),
written into the history, and closed by one ``ResponseDone`` with the engine's timeline."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable

from duplex_contract.errors import StageError
from duplex_contract.fence import Fence
from duplex_contract.session_events import (
    AudioChunk,
    FunctionCallDelta,
    ResponseDone,
    SessionEvent,
    TextDelta,
)
from duplex_contract.tools import ResponseOptions, ToolCall
from engine.config import EngineConfig
from engine.duplex.session import DuplexSession, TurnJob
from engine.orchestration.counters import Counters
from engine.orchestration.draft_book import DraftBook
from engine.orchestration.drafts import Draft, response_plan, start_response
from engine.orchestration.history import ConversationHistory
from engine.orchestration.output_router import Emit
from engine.orchestration.prompt_warm import warm_next_prompt, warms
from engine.orchestration.speculation import SpeculativeAsr
from engine.orchestration.tool_calls import CallStream, finish_call
from engine.pipeline.pipeline import LlmResult, Pipeline, SpokenChunk

log = logging.getLogger(__name__)


class ResponseStream:
    """One response's outputs on their way to its session: text deltas, function-call
    pieces and spoken chunks become events, what is said goes into the history (unless the
    response is out of band), each output lets batch work go on (``leave_critical``), and
    ``marks`` gets the first token's and the first audio's times (ms from ``t_llm``)."""

    def __init__(
        self,
        sid: str,
        fence: Fence,
        history: ConversationHistory,
        marks: dict[str, float],
        *,
        record: bool,
        want_text: bool,
        want_audio: bool,
        emit: Emit,
        leave_critical: Callable[[str], None],
    ) -> None:
        self.sid, self.fence = sid, fence
        self.prefix = fence.key()
        self.history = history
        self.marks = marks
        self.record = record
        self.want_text, self.want_audio = want_text, want_audio
        self._emit = emit
        self._leave_critical = leave_critical
        self.calls = CallStream()
        self.call_id = f"call_{secrets.token_hex(12)}"
        self.t_llm = time.perf_counter()

    def emit(self, event: SessionEvent) -> None:
        self._emit(self.sid, event)

    def on_text(self, delta: str) -> None:
        marks = self.marks
        if "llm_first_token" not in marks:
            marks["llm_first_token"] = (time.perf_counter() - self.t_llm) * 1000
        if not self.want_audio:
            self._leave_critical(self.prefix)
        if self.want_text:
            self._emit(self.sid, TextDelta(fence=self.fence, text=delta))
        if not self.want_audio and self.record:
            fence = self.fence
            self.history.append_assistant_text(fence.turn_id, fence.response_seq, delta)

    def on_call(self, piece: str) -> None:
        self._leave_critical(self.prefix)
        delta = self.calls.push(piece)
        if delta:
            self._emit(
                self.sid,
                FunctionCallDelta(
                    fence=self.fence,
                    call_id=self.call_id,
                    name=self.calls.name or "",
                    delta=delta,
                ),
            )

    def on_chunk(self, chunk: SpokenChunk) -> None:
        marks = self.marks
        if "tts_first_audio" not in marks:
            first = marks.get("llm_first_token", 0.0)
            marks["tts_first_audio"] = (time.perf_counter() - self.t_llm) * 1000 - first
        self._leave_critical(self.prefix)
        fence = self.fence
        if self.record:
            self.history.append_assistant(
                fence.turn_id,
                fence.response_seq,
                chunk.mark,
                chunk.audio_start_ms,
                chunk.duration_ms,
            )
        self._emit(
            self.sid,
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

    def keep_call(self, call: ToolCall) -> None:
        """The validated function call goes into the history (unless out of band)."""
        if self.record:
            self.history.set_tool_call(self.fence.turn_id, self.fence.response_seq, call)

    def finish_history(self) -> None:
        if self.record:
            self.history.finish_assistant(self.fence.turn_id, self.fence.response_seq, "completed")


class Responder:
    """Answers committed turns on the orchestrator's loop, through ``pipeline``; adopts the
    draft of ``drafts`` that answers a turn already (engine/orchestration/draft_book.py)."""

    def __init__(
        self,
        config: EngineConfig,
        pipeline: Pipeline,
        drafts: DraftBook,
        speculation: SpeculativeAsr,
        counters: Counters,
        *,
        emit: Emit,
        leave_critical: Callable[[str], None],
    ) -> None:
        self._config = config
        self._pipeline = pipeline
        self._drafts = drafts
        self._warming: set[asyncio.Task[bool]] = set()  # warm-ups of next prompts in flight
        self._speculation = speculation
        self._counters = counters
        self._emit = emit
        self._leave_critical = leave_critical

    async def respond(
        self, session: DuplexSession, job: TurnJob, marks: dict[str, float] | None = None
    ) -> None:
        """The response of ``job``: text and audio, or one function call. ``marks``
        collects the engine's timeline (ms: asr_wait, llm_first_token, tts_first_audio)."""
        marks = {} if marks is None else marks
        sid, fence = session.session_id, job.fence
        prefix = fence.key()
        opts = job.response or ResponseOptions()
        record = opts.conversation != "none"  # out of band: the history is not written
        plan = response_plan(self._config, session, opts)
        want_text = "text" in (opts.output_modalities or session.config.output_modalities)
        draft = self._drafts.take(sid, plan, prefix)
        if record:
            session.history.start_assistant(fence.turn_id, fence.response_seq)
        out = ResponseStream(
            sid,
            fence,
            session.history,
            marks,
            record=record,
            want_text=want_text,
            want_audio=plan.route == "voice",
            emit=self._emit,
            leave_critical=self._leave_critical,
        )
        if draft is not None:
            result = await self._adopt(draft, out)
        else:
            result = await start_response(
                self._pipeline,
                prefix,
                sid,
                plan,
                on_text=out.on_text,
                on_chunk=out.on_chunk,
                on_call=out.on_call,
            )
        if draft is not None:
            marks.update(draft.segments())  # where the draft's own time went
        length = result.finish_reason == "length"
        if result.call:
            finish_call(out.calls, out.call_id, plan.tools, fence, out.emit, out.keep_call)
            out.finish_history()
            if length:
                raise StageError(
                    "the function call was cut at max_output_tokens", code="invalid_tool_call"
                )
        else:
            out.finish_history()
        self._speculation.answered(sid)  # the session's next words are a new utterance
        if (
            record
            and not result.call
            and self._config.prompt.warm_next_prompt
            and warms(self._pipeline, plan.route)
        ):
            self._warm(session, f"{prefix}/warm")
        self._emit(
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

    def _warm(self, session: DuplexSession, prefix: str) -> None:
        """Evaluate the head of the session's next prompt while this answer plays
        (engine/orchestration/prompt_warm.py); nothing waits for it."""
        task = asyncio.create_task(
            warm_next_prompt(self._pipeline, self._config, session, prefix), name=f"warm:{prefix}"
        )
        self._warming.add(task)
        task.add_done_callback(self._warm_done)

    def _warm_done(self, task: asyncio.Task[bool]) -> None:
        self._warming.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("warming the next prompt failed", exc_info=task.exception())

    async def _adopt(self, draft: Draft, out: ResponseStream) -> LlmResult:
        """The draft's result; what it held and what it makes from now on goes to ``out``."""
        assert draft.task is not None
        out.marks["speculative_ms"] = (out.t_llm - draft.created) * 1000  # how far ahead
        self._counters.drafts["used"] += 1
        draft.adopt(out.on_text, out.on_chunk, out.on_call)
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
        return drafted
