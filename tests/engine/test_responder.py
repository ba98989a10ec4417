"""Responder and ResponseStream (engine/orchestration/responder.py) on a scripted pipeline:
what a response streams (text or audio, a function call), what it writes into the history,
its timeline, and a draft adopted instead of a new stage request."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace
from typing import Any

import pytest

from duplex_contract.batch import AudioOut
from duplex_contract.errors import StageError
from duplex_contract.fence import Fence
from duplex_contract.session_events import (
    AudioChunk,
    FunctionCallDelta,
    FunctionCallDone,
    ResponseDone,
    TextDelta,
)
from duplex_contract.settings import Tool
from duplex_contract.tools import ResponseOptions
from engine.duplex.session import DuplexSession
from engine.messages import LlmRequest, Priority, StageDone
from engine.orchestration.counters import Counters
from engine.orchestration.drafts import Draft, ResponsePlan
from engine.orchestration.responder import Responder
from engine.pipeline.pipeline import LlmResult, SpokenChunk
from tests.engine.conftest import make_config, run
from tests.engine.parts_fakes import Calls, Emitted, job, session

SID = "sess_a"
FENCE = Fence(SID, 0, 1, 1)


def chunk(mark: str, start: float = 0.0) -> SpokenChunk:
    out = AudioOut(request_id="r", pcm=b"\1\0" * 2400, sample_rate=24000, t_ns=7)
    return SpokenChunk(out=out, audio_start_ms=start, duration_ms=100.0, mark=mark)


class Pipeline:
    """Plays ``script`` ((kind, item): "text", "chunk" or "call") into the callbacks."""

    def __init__(self, script: list[tuple[str, Any]], result: LlmResult, pool: Any = None) -> None:
        self.script, self.result = script, result
        self.calls: list[tuple[str, str]] = []
        #: the responder's pool (a warm-up of the next prompt goes there); None: no responder
        self.pools = {"llm": pool}
        self.slots = Slots()

    def route(self, name: str) -> Any:
        return SimpleNamespace(responder=SimpleNamespace(name="llm") if self.pools["llm"] else None)

    async def respond(
        self,
        prefix: str,
        messages: Any,
        *,
        route: str,
        on_text: Callable[[str], None],
        on_chunk: Callable[[SpokenChunk], None],
        on_call: Callable[[str], None],
        **kw: Any,
    ) -> LlmResult:
        self.calls.append((prefix, route))
        sinks: dict[str, Callable[[Any], None]] = {
            "text": on_text,
            "chunk": on_chunk,
            "call": on_call,
        }
        for kind, item in self.script:
            sinks[kind](item)
        return self.result


class Slots:
    @contextlib.asynccontextmanager
    async def slot(self, stage: str, request: Any) -> AsyncIterator[Any]:
        yield SimpleNamespace(output=lambda work: None)


class WarmPool:
    """A responder that keeps a prompt cache: records the warm-ups it is sent."""

    def __init__(self) -> None:
        self.replicas = [SimpleNamespace(warms_prompts=True)]
        self.requests: list[LlmRequest] = []

    async def submit(self, request: LlmRequest) -> AsyncIterator[StageDone]:
        self.requests.append(request)
        yield StageDone(request_id=request.request_id, finish_reason="stop")


class Drafts:
    def __init__(self, draft: Draft | None = None) -> None:
        self.draft = draft
        self.plans: list[ResponsePlan] = []

    def take(self, sid: str, plan: ResponsePlan, prefix: str) -> Draft | None:
        self.plans.append(plan)
        return self.draft


class Setup:
    def __init__(self, pipeline: Pipeline, drafts: Drafts | None = None, **settings: Any) -> None:
        self.session: DuplexSession = session(SID, **settings)
        self.pipeline = pipeline
        self.emitted = Emitted()
        self.log: list[tuple[Any, ...]] = []
        self.counters = Counters()
        self.responder = Responder(
            make_config(),
            pipeline,  # type: ignore[arg-type]
            drafts or Drafts(),  # type: ignore[arg-type]
            Calls(self.log),  # type: ignore[arg-type]  # the speculative transcripts
            self.counters,
            emit=self.emitted,
            leave_critical=lambda key: self.log.append(("leave_critical", key)),
        )

    def respond(self, opts: ResponseOptions | None = None) -> dict[str, float]:
        turn = job(FENCE, "hello")
        turn.response = opts
        marks: dict[str, float] = {"asr_wait": 12.0}
        run(self.responder.respond(self.session, turn, marks))
        return marks

    def done(self) -> ResponseDone:
        done = self.emitted.events()[-1]
        assert isinstance(done, ResponseDone)
        return done


def test_a_voice_response_streams_audio_and_writes_what_was_said() -> None:
    result = LlmResult(text="Hi there.", tokens=3, prompt_tokens=9, audio_ms=100.0)
    s = Setup(Pipeline([("text", "Hi there."), ("chunk", chunk("Hi there."))], result))
    marks = s.respond()
    assert s.pipeline.calls == [(FENCE.key(), "voice")]
    audio, done = s.emitted.events()
    assert isinstance(audio, AudioChunk) and audio.text == "Hi there." and audio.t_stage_ns == 7
    assert done.status == "completed" and done.text == "Hi there." and done.audio_ms == 100.0  # type: ignore[union-attr]
    assert (done.output_tokens, done.input_tokens) == (3, 9)  # type: ignore[union-attr]
    assert set(marks) == {"asr_wait", "llm_first_token", "tts_first_audio"}
    assert done.timing_ms is not None and set(done.timing_ms) == set(marks)  # type: ignore[union-attr]
    assert s.session.history.assistant_text(1, 1) == "Hi there."
    assert s.log == [("leave_critical", FENCE.key()), ("answered", SID)]


def test_a_text_response_streams_deltas() -> None:
    result = LlmResult(text="Hi there.")
    s = Setup(Pipeline([("text", "Hi "), ("text", "there.")], result), output_modalities=("text",))
    s.respond()
    assert s.pipeline.calls == [(FENCE.key(), "text")]
    assert s.emitted.events()[:2] == [
        TextDelta(fence=FENCE, text="Hi "),
        TextDelta(fence=FENCE, text="there."),
    ]
    assert s.done().status == "completed"
    assert s.session.history.assistant_text(1, 1) == "Hi there."


def test_an_out_of_band_response_leaves_the_history_alone() -> None:
    s = Setup(Pipeline([("text", "Aside.")], LlmResult(text="Aside.")))
    s.respond(ResponseOptions(conversation="none", output_modalities=("text",)))
    assert s.done().status == "completed"
    with pytest.raises(KeyError):
        s.session.history.assistant_text(1, 1)


def test_a_function_call_is_announced_and_kept() -> None:
    call = '{"name": "get_time", "arguments": {"tz": "UTC"}}'
    pieces = [("call", call[:30]), ("call", call[30:])]
    tool = Tool(name="get_time")
    s = Setup(Pipeline(pieces, LlmResult(text=call, call=True)), tools=(tool,))
    s.respond()
    events = s.emitted.events()
    deltas = [e.delta for e in events if isinstance(e, FunctionCallDelta)]
    assert "".join(deltas) == '{"tz": "UTC"}'
    (called,) = [e for e in events if isinstance(e, FunctionCallDone)]
    assert called.name == "get_time" and called.call_id.startswith("call_")
    assert s.done().status == "completed"


def test_a_call_cut_at_max_output_tokens_fails_the_turn() -> None:
    call = '{"name": "get_time", "arguments": {}}'
    result = LlmResult(text=call, call=True, finish_reason="length")
    s = Setup(Pipeline([("call", call)], result), tools=(Tool(name="get_time"),))
    with pytest.raises(StageError) as info:
        s.respond()
    assert info.value.code == "invalid_tool_call"


def test_a_draft_that_answers_the_turn_is_adopted() -> None:
    async def finished() -> LlmResult:
        return LlmResult(text="Hi there.")

    async def main() -> tuple[Setup, dict[str, float]]:
        draft = Draft(SID, 0, f"{SID}/e0/draft0")
        draft.mark("heard")  # its guess's words came
        draft.on_text("Hi there.")  # held until adopted
        draft.task = asyncio.create_task(finished())
        pipeline = Pipeline([], LlmResult())
        s = Setup(pipeline, Drafts(draft), output_modalities=("text",))
        turn = job(FENCE, "hello")
        marks: dict[str, float] = {}
        await s.responder.respond(s.session, turn, marks)
        assert draft.task is None and draft.adopted
        return s, marks

    s, marks = run(main())
    assert s.pipeline.calls == []  # no new stage request
    assert s.emitted.events()[0] == TextDelta(fence=FENCE, text="Hi there.")
    assert s.counters.drafts["used"] == 1 and "speculative_ms" in marks
    assert s.done().text == "Hi there."
    # where the draft's own time went: its guess heard, then its first token (no audio)
    assert marks["draft_asr"] >= 0 and marks["draft_llm"] >= 0 and "draft_tts" not in marks
    assert {"draft_asr", "draft_llm"} <= set(s.done().timing_ms or {})


def test_a_draft_without_a_result_fails_loudly() -> None:
    async def nothing() -> None:
        return None

    async def main() -> None:
        draft = Draft(SID, 0, f"{SID}/e0/draft0")
        draft.task = asyncio.create_task(nothing())  # type: ignore[arg-type]
        s = Setup(Pipeline([], LlmResult()), Drafts(draft))
        with pytest.raises(StageError):
            await s.responder.respond(s.session, job(FENCE, "hello"))

    run(main())


def test_a_finished_answer_warms_the_next_prompt_once() -> None:
    """Once a response has ended, the head of the session's next prompt goes to a responder
    that keeps a prompt cache, at background priority (engine/orchestration/prompt_warm.py);
    not after a function call (its output comes next), and not when turned off."""
    pool = WarmPool()
    result = LlmResult(text="Hi there.", tokens=3, prompt_tokens=9, audio_ms=100.0)
    s = Setup(Pipeline([("text", "Hi there."), ("chunk", chunk("Hi there."))], result, pool))

    s.session.history.add_user("hello", FENCE.turn_id)  # (what the control plane does)
    run(answer_with(s))
    (req,) = pool.requests
    assert req.prefill_only and req.priority == Priority.SPECULATIVE
    assert req.request_id == f"{FENCE.key()}/warm/llm"
    # the next prompt starts with the turn that just ended (the test config keeps it as
    # chat messages), and leaves out the user's next words
    assert [(m.role, m.content) for m in req.messages[1:]] == [
        ("user", "hello"),
        ("assistant", "Hi there."),
    ]
    tool = Tool(name="get_time")
    call = '{"name": "get_time", "arguments": {"tz": "UTC"}}'
    calling = WarmPool()
    c = Setup(Pipeline([("call", call)], LlmResult(text=call, call=True), calling), tools=(tool,))
    run(answer_with(c))
    assert calling.requests == []


async def answer_with(s: Setup) -> None:
    await s.responder.respond(s.session, job(FENCE, "hello"), {})
    for _ in range(5):  # the warm-up runs beside, after the response
        await asyncio.sleep(0)
