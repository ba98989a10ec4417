"""LLM stage (SmolLM2-135M on llama.cpp): greedy replies, streaming == batch, limits, abort."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest

from duplex_contract.batch import ChatMessage, TextOut
from duplex_contract.errors import StageError
from duplex_contract.settings import Tool
from duplex_contract.tools import check_call, tools_prompt
from engine.messages import LlmRequest, StageDone
from engine.stages.llm_llamacpp import LlamaCppLlm, LlamaCppOptions, open_llama
from tests.stages.helpers import run_request

pytestmark = pytest.mark.models

SYSTEM = ChatMessage(role="system", content="You are a helpful voice assistant. Answer briefly.")
QUESTION = ChatMessage(role="user", content="What is the weather like today?")
COMMON = {"the", "a", "is", "it", "i", "you", "to", "and", "of", "in", "with", "today"}


@pytest.fixture(scope="module")
def reference() -> Iterator[Any]:
    """A second, independent Llama: llama-cpp-python's own non-streaming chat completion."""
    llama = open_llama(LlamaCppOptions())
    yield llama
    llama.close()


def _batch(reference: Any, messages: tuple[ChatMessage, ...], max_tokens: int) -> tuple[str, Any]:
    out = reference.create_chat_completion(
        messages=[{"role": m.role, "content": m.content} for m in messages],
        temperature=0.0,
        max_tokens=max_tokens,
    )
    return out["choices"][0]["message"]["content"], out


def test_greedy_reply_is_english_stops_and_matches_batch(llm: LlamaCppLlm, reference: Any) -> None:
    messages = (SYSTEM, QUESTION)
    run = run_request(llm, LlmRequest(request_id="g", messages=messages, max_tokens=64))
    done = run.done
    text = run.text
    assert done.finish_reason == "stop" and 0 < done.tokens < 64
    assert text.strip() and "<|im_end|>" not in text and "<|im_start|>" not in text
    words = re.findall(r"[A-Za-z']+", text)
    letters = sum(c.isascii() and c.isalpha() for c in text)
    assert len(words) >= 3 and letters >= 0.8 * len(text.replace(" ", ""))  # English text
    assert COMMON & {w.lower() for w in words}
    deltas = [o for o in run.outputs if isinstance(o, TextOut)]
    assert 0.9 * done.tokens <= len(deltas) <= done.tokens  # one delta per token piece
    batch, raw = _batch(reference, messages, 64)
    assert text == batch
    assert raw["usage"]["completion_tokens"] == done.tokens
    assert raw["usage"]["prompt_tokens"] == done.prompt_tokens
    assert raw["choices"][0]["finish_reason"] == "stop"


def test_second_turn_reuses_the_cache_and_stays_exact(llm: LlamaCppLlm, reference: Any) -> None:
    first = run_request(llm, LlmRequest(request_id="t1", messages=(SYSTEM, QUESTION)))
    history = (
        SYSTEM,
        QUESTION,
        ChatMessage(role="assistant", content=first.text),
        ChatMessage(role="user", content="And what should I wear?"),
    )
    second = run_request(llm, LlmRequest(request_id="t2", messages=history, max_tokens=48))
    assert second.text.strip()
    assert second.text == _batch(reference, history, 48)[0]


def test_max_tokens_gives_length(llm: LlamaCppLlm) -> None:
    story = ChatMessage(role="user", content="Tell me a long story about a dragon.")
    run = run_request(llm, LlmRequest(request_id="l", messages=(story,), max_tokens=5))
    done = run.done
    assert (done.finish_reason, done.tokens) == ("length", 5) and done.prompt_tokens > 5
    assert run.text.strip()


def test_sampling_with_temperature_runs(llm: LlamaCppLlm) -> None:
    req = LlmRequest(request_id="s", messages=(SYSTEM, QUESTION), max_tokens=16, temperature=0.8)
    run = run_request(llm, req)
    assert run.text.strip() and run.done.finish_reason in ("stop", "length")


async def _abort_mid_generation(llm: LlamaCppLlm) -> None:
    story = ChatMessage(role="user", content="Write a very long story about a brave knight.")
    request = LlmRequest(request_id="abort-llm", messages=(story,), max_tokens=400)
    seen = 0
    after_abort: list[object] = []
    aborted_at = 0.0
    async for out in llm.submit(request):
        if aborted_at:
            after_abort.append(out)
            continue
        if isinstance(out, TextOut):
            seen += 1
            if seen == 3:
                aborted_at = time.perf_counter()
                await llm.abort([request.request_id])
    stop_latency = time.perf_counter() - aborted_at
    # nothing more of it, only its end: aborted, with what it read and made by then (usage)
    assert len(after_abort) == 1 and isinstance(done := after_abort[0], StageDone), after_abort
    assert done.request_id == "abort-llm" and done.finish_reason == "aborted"
    assert done.prompt_tokens > 0 and 3 <= done.tokens <= 4, done
    assert stop_latency < 0.5  # one token is ~15 ms; the worker checks between tokens


def test_abort_stops_within_one_token(llm: LlamaCppLlm, reference: Any) -> None:
    asyncio.run(_abort_mid_generation(llm))
    # The worker is consistent afterwards: the same greedy answer as a fresh model.
    run = run_request(llm, LlmRequest(request_id="after", messages=(SYSTEM, QUESTION)))
    assert run.text == _batch(reference, (SYSTEM, QUESTION), 128)[0]


def test_prompt_too_long_fails_the_request_only(llm: LlamaCppLlm) -> None:
    huge = ChatMessage(role="user", content="word " * 3000)
    with pytest.raises(StageError):
        run_request(llm, LlmRequest(request_id="big", messages=(huge,)))
    ok = run_request(llm, LlmRequest(request_id="ok", messages=(QUESTION,), max_tokens=4))
    assert ok.done.tokens == 4 or ok.done.finish_reason == "stop"


ALARM = Tool(
    name="set_alarm",
    description="Set an alarm",
    parameters=json.dumps(
        {
            "type": "object",
            "properties": {"hour": {"type": "integer"}, "label": {"type": "string"}},
            "required": ["hour", "label"],
            "additionalProperties": False,
        }
    ),
)


def test_required_tool_call_is_schema_valid_json(llm: LlamaCppLlm) -> None:
    """Under tool_required the grammar makes the whole output one call of the tool."""
    system = ChatMessage(role="system", content=f"Answer briefly.\n{tools_prompt((ALARM,), True)}")
    ask = ChatMessage(role="user", content="Wake me up at seven.")
    req = LlmRequest(
        request_id="t1", messages=(system, ask), max_tokens=64, tools=(ALARM,), tool_required=True
    )
    run = run_request(llm, req)
    text = "".join(o.text for o in run.outputs if isinstance(o, TextOut))
    call = check_call(text, (ALARM,))  # raises if not JSON or not schema-valid
    assert call.name == "set_alarm" and set(json.loads(call.arguments)) == {"hour", "label"}


def test_auto_tools_plain_text_reply_is_not_constrained(llm: LlamaCppLlm) -> None:
    """Under auto, output that does not open with '{' is plain text, exactly as without tools."""
    plain = run_request(
        llm, LlmRequest(request_id="t2", messages=(SYSTEM, QUESTION), max_tokens=12)
    )
    auto = LlmRequest(request_id="t3", messages=(SYSTEM, QUESTION), max_tokens=12, tools=(ALARM,))
    got = run_request(llm, auto)
    texts = ["".join(o.text for o in r.outputs if isinstance(o, TextOut)) for r in (plain, got)]
    assert not texts[0].lstrip().startswith("{") and texts[0] == texts[1]


def test_decoding_pauses_while_its_own_first_clause_is_spoken(reference: Any) -> None:
    """``first_clause_pause_s``: between tokens the LLM waits while urgent work of its own
    response runs (its first clause in the TTS, engine/stages/compute.py), not for another
    response's; the reply is the same."""
    import threading
    import time

    from engine.stages import compute

    llm = LlamaCppLlm(LlamaCppOptions(n_threads=1), "llm-pause")
    asyncio.run(llm.start())
    try:
        plain = run_request(llm, LlmRequest(request_id="s/e0/r0/llm", messages=(SYSTEM, QUESTION)))
        assert llm.first_clause_pauses == 0
        release = threading.Event()

        def hold() -> None:
            with compute.urgent("s/e0/r1"):
                release.wait(5)

        holder = threading.Thread(target=hold)
        holder.start()
        # another response's first clause: no pause
        other = run_request(llm, LlmRequest(request_id="s/e0/r2/llm", messages=(SYSTEM, QUESTION)))
        assert llm.first_clause_pauses == 0
        threading.Timer(0.5, release.set).start()
        t0 = time.monotonic()
        own = run_request(llm, LlmRequest(request_id="s/e0/r1/llm", messages=(SYSTEM, QUESTION)))
        assert llm.first_clause_pauses == 1 and time.monotonic() - t0 >= 0.4
        holder.join()
        assert own.text == other.text == plain.text
    finally:
        asyncio.run(llm.close())


def test_threads_alone_while_no_other_stage_computes(reference: Any) -> None:
    """``n_threads_alone``: the LLM decodes with more threads while no other stage of the
    engine computes (engine/stages/compute.py), and with ``n_threads`` while one does,
    switching between tokens; the greedy reply is the same either way."""
    from engine.stages import compute

    llm = LlamaCppLlm(LlamaCppOptions(n_threads=1, n_threads_alone=2), "llm-alone")
    asyncio.run(llm.start())
    try:
        alone = run_request(llm, LlmRequest(request_id="a", messages=(SYSTEM, QUESTION)))
        assert llm._threads == 2 and llm.thread_switches == 1
        with compute.working("tts"):  # another stage is busy: back to one thread
            shared = run_request(llm, LlmRequest(request_id="b", messages=(SYSTEM, QUESTION)))
            assert llm._threads == 1 and llm.thread_switches == 2
        assert shared.text == alone.text == _batch(reference, (SYSTEM, QUESTION), 256)[0]
        # its own work does not count as another stage's
        with compute.working("llm-alone"):
            run_request(llm, LlmRequest(request_id="c", messages=(SYSTEM, QUESTION)))
        assert llm._threads == 2
    finally:
        asyncio.run(llm.close())
