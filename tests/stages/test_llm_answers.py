"""Answers a listener can use from SmolLM2-135M (real model): the loop guard ends a looping
answer, the sentence stop ends a spoken one after two sentences, the prompt of configs/cpu.yaml
keeps a question in English."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from duplex_contract.batch import ChatMessage
from engine.config import load_engine_config
from engine.orchestration.history import ConversationHistory
from engine.orchestration.prompt import build_prompt
from engine.pipeline.segmenter import SentenceStop
from engine.stages.llm_llamacpp import LlamaCppLlm, LlamaCppOptions

pytestmark = pytest.mark.models

ROOT = Path(__file__).resolve().parents[2]
OLD_SYSTEM = ChatMessage(
    role="system", content="You are a helpful voice assistant. Answer briefly."
)


@pytest.fixture(scope="module")
def guarded() -> Iterator[LlamaCppLlm]:
    """The model as configs/cpu.yaml had it before (no repeat penalty), with the loop guard."""
    llm = LlamaCppLlm(LlamaCppOptions(n_threads=1, loop_ngram=8), "guarded")
    llm.load()
    yield llm
    llm.unload()


def _answer(
    llm: LlamaCppLlm, messages: tuple[ChatMessage, ...], max_tokens: int = 96
) -> tuple[str, str, int]:
    text, reason, n = "", "", 0
    for item in llm.generate(messages, max_tokens=max_tokens, temperature=0.0, cancelled=None):
        if isinstance(item, str):
            text += item
        else:
            reason, n, _ = item
    return text, reason, n


def test_the_loop_guard_ends_a_looping_answer(guarded: LlamaCppLlm, llm: LlamaCppLlm) -> None:
    question = ChatMessage(role="user", content="Name an animal that can swim.")
    looping, reason, n = _answer(llm, (OLD_SYSTEM, question))  # no guard: 96 tokens of a loop
    assert reason == "length" and n == 96
    text, reason, n = _answer(guarded, (OLD_SYSTEM, question))
    assert reason == "stop" and n < 40
    assert looping.startswith(text)  # the same answer, ended where it began its 3rd round


def test_the_sentence_stop_ends_a_spoken_answer_after_two_sentences(llm: LlamaCppLlm) -> None:
    question = ChatMessage(role="user", content="Tell me about the sun.")
    full, _, _ = _answer(llm, (OLD_SYSTEM, question))
    stop = SentenceStop(2)
    spoken = ""
    for item in llm.generate(
        (OLD_SYSTEM, question), max_tokens=96, temperature=0.0, cancelled=None
    ):
        if isinstance(item, str):
            spoken += stop.push(item)
            if stop.stopped:
                break
    assert stop.stopped and full.startswith(spoken) and len(spoken) < len(full)
    assert spoken.rstrip()[-1] in ".!?" and spoken.count(". ") + spoken.count("! ") <= 1


def test_the_cpu_prompt_answers_in_english_without_a_loop(llm: LlamaCppLlm) -> None:
    """configs/cpu.yaml's prompt: "What is the capital of France?" got a French loop before."""
    cfg = load_engine_config(ROOT / "configs" / "cpu.yaml")
    h = ConversationHistory(cfg.duplex.history_budget_chars)
    h.add_user("What is the capital of France?", 1)
    messages = build_prompt(
        h.messages(cfg.default_instructions), cfg.prompt, spoken=True, language="en"
    )
    text, reason, n = _answer(llm, messages, cfg.max_output_tokens)
    assert reason == "stop" and n < 40
    assert "Paris" in text and "Le " not in text
