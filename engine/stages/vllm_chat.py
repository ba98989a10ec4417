"""The chat prompt of the vLLM text stage (engine/stages/llm_vllm.py): the request's messages
rendered with the model's chat template, trimmed from the oldest turn to leave room for the
reply. Pure functions of a Hugging Face tokenizer (no vLLM import)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from duplex_contract.batch import ChatMessage
from duplex_contract.errors import StageError


def render(tokenizer: Any, messages: Sequence[ChatMessage]) -> list[int]:
    """Token ids of ``messages`` under the chat template, ending with the reply's prompt."""
    text = tokenizer.apply_chat_template(
        [{"role": m.role, "content": m.content} for m in messages],
        tokenize=False,
        add_generation_prompt=True,
    )
    ids: list[int] = tokenizer.encode(text, add_special_tokens=False)
    return ids


def fit_prompt(
    tokenizer: Any,
    messages: Sequence[ChatMessage],
    max_tokens: int,
    max_model_len: int,
    name: str,
) -> tuple[list[int], int]:
    """(prompt ids, reply tokens): the chat rendered, its oldest turns (never the system
    prompt, never the last message) dropped while it leaves no room for the reply."""
    kept = list(messages)
    want = max(1, min(max_tokens, max_model_len // 4))
    while True:
        ids = render(tokenizer, kept)
        room = max_model_len - len(ids)
        droppable = [i for i, m in enumerate(kept) if m.role != "system"][:-1]
        if room >= want or not droppable:
            break
        del kept[droppable[0]]
    if room < 1:
        raise StageError(
            f"{name}: prompt of {len(ids)} tokens does not fit max_model_len={max_model_len}"
        )
    return ids, max(1, min(max_tokens, room))


__all__ = ["fit_prompt", "render"]
