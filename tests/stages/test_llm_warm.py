"""llama.cpp's prompt warm-up (``LlmRequest.prefill_only``, engine/orchestration/prompt_warm.py)
on SmolLM2-135M: a warmed head is found in the KV cache by the prompt that goes on from it,
and that prompt's answer is the one a fresh model gives; a warm-up gives way to other work."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from duplex_contract.batch import ChatMessage, TextOut
from engine.messages import LlmRequest, StageDone
from engine.stages import compute
from engine.stages.llm_llamacpp import LlamaCppLlm, LlamaCppOptions, open_llama
from tests.stages.helpers import run_request

pytestmark = pytest.mark.models

SYSTEM = ChatMessage(role="system", content="You are a helpful voice assistant. Answer briefly.")
NOTE = ChatMessage(
    role="system",
    content="You are a helpful voice assistant. Answer briefly.\nEarlier in this conversation: "
    "User: What is the capital of France? You: Paris is the capital of France.",
)
HEAD = (
    SYSTEM,
    ChatMessage(role="user", content="Hi"),
    ChatMessage(role="assistant", content="Hello!"),
    NOTE,
)
NEXT = ChatMessage(role="user", content="And what is the capital of Spain?")
OTHER = (
    ChatMessage(role="system", content="Count to three."),
    ChatMessage(role="user", content="Go"),
)


@pytest.fixture(scope="module")
def reference() -> Iterator[Any]:
    """A second, independent Llama: llama-cpp-python's own chat completion, cold."""
    llama = open_llama(LlamaCppOptions())
    yield llama
    llama.close()


def _reference(reference: Any, messages: tuple[ChatMessage, ...], max_tokens: int) -> str:
    out = reference.create_chat_completion(
        messages=[{"role": m.role, "content": m.content} for m in messages],
        temperature=0.0,
        max_tokens=max_tokens,
    )
    text: str = out["choices"][0]["message"]["content"]
    return text


def test_a_warmed_head_is_reused_and_the_answer_stays_exact(
    llm: LlamaCppLlm, reference: Any
) -> None:
    run_request(llm, LlmRequest(request_id="other", messages=OTHER, max_tokens=8))
    cold = run_request(llm, LlmRequest(request_id="cold", messages=(*HEAD, NEXT), max_tokens=24))
    assert llm.reused < 8  # (its system message differs from OTHER's at once)
    run_request(llm, LlmRequest(request_id="other2", messages=OTHER, max_tokens=8))
    warmed = llm.warmed
    warm = run_request(llm, LlmRequest(request_id="w", messages=HEAD, prefill_only=True))
    (done,) = warm.outputs  # nothing but its end
    assert isinstance(done, StageDone) and done.finish_reason == "stop" and done.tokens == 0
    assert done.prompt_tokens > 60 and llm.warmed == warmed + 1
    hot = run_request(llm, LlmRequest(request_id="hot", messages=(*HEAD, NEXT), max_tokens=24))
    assert llm.reused == done.prompt_tokens  # the whole head: only the question was evaluated
    assert hot.done.prompt_tokens > llm.reused
    assert hot.text == cold.text == _reference(reference, (*HEAD, NEXT), 24)
    again = run_request(llm, LlmRequest(request_id="w2", messages=HEAD, prefill_only=True))
    assert again.done.finish_reason == "stop"  # what it holds already is kept, not redone
    assert not any(isinstance(o, TextOut) for o in again.outputs)


def test_a_warm_up_gives_way_to_other_work(
    llm: LlamaCppLlm, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_request(llm, LlmRequest(request_id="other", messages=OTHER, max_tokens=8))
    monkeypatch.setattr(compute, "others_busy", lambda name: True)  # e.g. Whisper runs
    warmed = llm.warmed
    cut = run_request(llm, LlmRequest(request_id="w", messages=HEAD, prefill_only=True))
    assert cut.done.finish_reason == "aborted" and llm.warmed == warmed
    monkeypatch.undo()
    run_request(llm, LlmRequest(request_id="next", messages=(*HEAD, NEXT), max_tokens=4))
    assert llm.reused < 8  # nothing of the head was evaluated
