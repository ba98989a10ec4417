"""The next prompt's head, evaluated ahead (``engine.prompt.warm_next_prompt``).

A response's prompt is the system message, the spoken examples, the history note and the
user's newest words (engine/orchestration/prompt.py). Once a response has ended, all of the
next prompt but those words is known: the history note has just grown by the turn that
ended. llama.cpp keeps the KV cache of the last prompt it evaluated and re-evaluates a new
prompt from the first token where the two differ, so each answer re-evaluated the note's
new part, ~40-60 tokens of SmolLM2 on the CPU default, before its first token. Warming
evaluates that head while the answer plays (a ``prefill_only`` request at
``Priority.SPECULATIVE``, which the backend cuts short once other work waits or another
stage computes), so the next draft or turn evaluates only the user's words.

Backends without a prompt cache of their own (their ``warms_prompts`` is not true) get no
such request; vLLM's prefix cache needs none.
"""

from __future__ import annotations

import logging

from duplex_contract.errors import StageError
from duplex_contract.tools import ResponseOptions
from engine.config import EngineConfig
from engine.duplex.session import DuplexSession
from engine.messages import LlmRequest, Priority, StageDone
from engine.orchestration.drafts import response_plan
from engine.pipeline.pipeline import Pipeline

log = logging.getLogger(__name__)

#: stands for the user's next words while the prompt is built (a history drops an empty
#: turn); the message that holds it is left out of the head
_WORDS = "..."


def warms(pipeline: Pipeline, route: str) -> bool:
    """``route``'s responder keeps a prompt cache that a warm-up fills (every replica)."""
    stage = pipeline.route(route).responder
    if stage is None:
        return False
    return all(
        getattr(r, "warms_prompts", False) is True for r in pipeline.pools[stage.name].replicas
    )


async def warm_next_prompt(
    pipeline: Pipeline, config: EngineConfig, session: DuplexSession, prefix: str
) -> bool:
    """Evaluate the head of ``session``'s next prompt (its next response with the default
    options, all of it but the user's words) into its responder's prompt cache, under the
    request id ``{prefix}/{stage}``. True when the whole head is in the cache."""
    plan = response_plan(config, session, ResponseOptions(), pending_user=_WORDS)
    stage = pipeline.route(plan.route).responder
    last = plan.messages[-1] if plan.messages else None
    if stage is None or last is None or last.role != "user" or last.content != _WORDS:
        return False
    if not warms(pipeline, plan.route):
        return False
    req = LlmRequest(
        request_id=f"{prefix}/{stage.name}",
        messages=plan.messages[:-1],
        priority=Priority.SPECULATIVE,
        session_id=session.session_id,
        prefill_only=True,
    )
    done: StageDone | None = None
    try:
        async with pipeline.slots.slot(stage.name, req) as ticket:
            async for out in pipeline.pools[stage.name].submit(req):
                ticket.output(not isinstance(out, StageDone))
                if isinstance(out, StageDone):
                    done = out
    except StageError as exc:  # background work: the next prompt is evaluated whole then
        log.debug("%s: the next prompt not warmed: %s", prefix, exc)
        return False
    return done is not None and done.finish_reason == "stop"
