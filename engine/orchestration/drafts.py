"""Speculative responses: the answer to a pause, generated before the turn commits, held.

When a pause's speculative transcript is ready (engine/orchestration/speculation.py) and no real
turn is running in the engine, the orchestrator starts the response that turn would get (the same
prompt, options, stages) as a *draft*, under a stage-request prefix of its own in the
session's epoch (``sess_x/e3/draft7/...``). Everything the draft produces (text deltas,
spoken chunks, call pieces) is held in memory and never emitted.

At commit, the turn's response *adopts* the draft when it would be the same request (an
equal :class:`ResponsePlan`: the prompt with the same transcript, route, options, voice):
the held outputs go through the turn's own callbacks, in order and once, under the turn's
fence, and the rest streams through them as it is produced. Anything else drops the draft:
speech that resumes (``input.resume``), a newer pause, a barge-in, a close, a commit whose
plan differs (or that asks for no response), or another session's real turn starting (a
draft never holds a stage a real turn waits for). A dropped draft's stage requests are
aborted and nothing it held is ever sent.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from duplex_contract.batch import ChatMessage
from duplex_contract.settings import Tool
from duplex_contract.tools import ResponseOptions, active_tools, tools_prompt
from engine.messages import Priority
from engine.orchestration.prompt import build_prompt
from engine.pipeline.pipeline import LlmResult, Pipeline, SpokenChunk
from engine.pipeline.stage_slots import Urgency

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.duplex.session import DuplexSession

_Kind = Literal["text", "chunk", "call"]


@dataclass(frozen=True)
class ResponsePlan:
    """What a response's stage work depends on: equal plans give the same response."""

    messages: tuple[ChatMessage, ...]
    route: str
    max_tokens: int
    temperature: float
    voice: str | None
    sample_rate: int
    tools: tuple[Tool, ...]
    tool_required: bool
    max_sentences: int | None = None  # a spoken reply ends after this many sentences ...
    max_words: int | None = None  # ... or the first one ending past this many words


class Draft:
    """One session's speculative response: held outputs, then a sink once adopted."""

    def __init__(self, session_id: str, epoch: int, prefix: str) -> None:
        self.session_id = session_id
        self.epoch = epoch
        self.prefix = prefix  # its stage requests are ``{prefix}/...``
        self.plan: ResponsePlan | None = None  # set when its generation starts
        self.task: asyncio.Task[LlmResult | None] | None = None
        self.created = time.perf_counter()
        self.held_bytes = 0  # audio held (bytes of PCM16)
        self._held: list[tuple[_Kind, Any]] = []
        self._sink: dict[_Kind, Callable[[Any], None]] | None = None
        #: when its guess was heard, its first token came, its first audio (perf_counter)
        self._at: dict[str, float] = {}

    def mark(self, moment: str) -> None:
        """``moment`` ("heard", "first_token", "first_audio") happened now (first time only)."""
        self._at.setdefault(moment, time.perf_counter())

    def segments(self) -> dict[str, float]:
        """Where the draft's time went (ms): ``draft_asr`` (start -> its guess heard),
        ``draft_llm`` (-> first token), ``draft_tts`` (-> first audio), those that happened."""
        at, out = {"start": self.created, **self._at}, {}
        for name, a, b in (
            ("draft_asr", "start", "heard"),
            ("draft_llm", "heard", "first_token"),
            ("draft_tts", "first_token", "first_audio"),
        ):
            if a in at and b in at:
                out[name] = (at[b] - at[a]) * 1000
        return out

    @property
    def adopted(self) -> bool:
        return self._sink is not None

    def urgency(self) -> Priority:
        """The priority of its next stage request: below every real-time request until a
        turn adopts it, then real-time (engine/messages.py ``Priority.DRAFT``)."""
        return Priority.REALTIME if self._sink is not None else Priority.DRAFT

    def _put(self, kind: _Kind, item: Any) -> None:
        if self._sink is not None:
            self._sink[kind](item)
        else:
            self._held.append((kind, item))

    def on_text(self, delta: str) -> None:
        self.mark("first_token")
        self._put("text", delta)

    def on_chunk(self, chunk: SpokenChunk) -> None:
        self.mark("first_audio")
        if self._sink is None:
            self.held_bytes += len(chunk.out.pcm)
        self._put("chunk", chunk)

    def on_call(self, piece: str) -> None:
        self._put("call", piece)

    def adopt(
        self,
        on_text: Callable[[str], None],
        on_chunk: Callable[[SpokenChunk], None],
        on_call: Callable[[str], None],
    ) -> int:
        """Release the held outputs to the turn's callbacks, in order, then stream the rest
        to them. Returns how many held outputs were released."""
        if self._sink is not None:
            raise RuntimeError("a draft is adopted once")
        held, self._held = self._held, []
        self.held_bytes = 0
        self._sink = {"text": on_text, "chunk": on_chunk, "call": on_call}
        for kind, item in held:
            self._sink[kind](item)
        return len(held)

    def discard(self) -> None:
        """Forget what it holds (it is being dropped)."""
        self._held.clear()
        self.held_bytes = 0


def response_plan(
    config: EngineConfig,
    session: DuplexSession,
    opts: ResponseOptions,
    pending_user: str | None = None,
) -> ResponsePlan:
    """The stage request a response of ``session`` with ``opts`` makes now (with
    ``pending_user``: as if that user text had been added to the history first)."""
    cfg = session.config
    modalities = opts.output_modalities or cfg.output_modalities
    choice = opts.tool_choice or cfg.tool_choice
    name = opts.tool_name if opts.tool_choice is not None else cfg.tool_name
    tools = active_tools(opts.tools if opts.tools is not None else cfg.tools, choice, name)
    required = bool(tools) and choice in ("required", "function")
    instructions = opts.instructions or cfg.instructions or config.default_instructions
    if tools:
        instructions = f"{instructions}\n\n{tools_prompt(tools, required)}"
    if opts.input is not None:
        messages: tuple[ChatMessage, ...] = (
            ChatMessage(role="system", content=instructions),
            *(ChatMessage(role=m.role, content=m.content) for m in opts.input),
        )
    else:
        messages = session.history.messages(instructions, pending_user)
    spoken = "audio" in modalities
    messages = build_prompt(messages, config.prompt, spoken=spoken, language=cfg.language)
    return ResponsePlan(
        messages=messages,
        route="voice" if spoken else "text",
        max_tokens=opts.max_output_tokens or cfg.max_output_tokens or config.max_output_tokens,
        temperature=next((t for t in (opts.temperature, cfg.temperature) if t is not None), 0.0),
        voice=cfg.voice,
        sample_rate=cfg.output_sample_rate,
        tools=tools,
        tool_required=required,
        max_sentences=config.prompt.spoken_max_sentences if spoken and not tools else None,
        max_words=config.prompt.spoken_max_words if spoken and not tools else None,
    )


async def start_response(
    pipeline: Pipeline,
    prefix: str,
    sid: str,
    plan: ResponsePlan,
    *,
    on_text: Callable[[str], None],
    on_chunk: Callable[[SpokenChunk], None],
    on_call: Callable[[str], None],
    urgency: Urgency | None = None,
) -> LlmResult:
    """The stage work of ``plan`` under the request prefix ``prefix``, its outputs to the
    callbacks: a turn's own, at real-time priority, or a draft's that hold them, at the
    draft's ``urgency``."""
    return await pipeline.respond(
        prefix,
        plan.messages,
        route=plan.route,
        max_tokens=plan.max_tokens,
        temperature=plan.temperature,
        voice=plan.voice,
        sample_rate=plan.sample_rate,
        session_id=sid,
        priority=urgency or Priority.REALTIME,
        on_text=on_text,
        on_chunk=on_chunk,
        tools=plan.tools,
        tool_required=plan.tool_required,
        on_call=on_call,
        max_sentences=plan.max_sentences,
        max_words=plan.max_words,
    )


def plan_diff(a: ResponsePlan, b: ResponsePlan) -> str:
    """The fields in which two response plans differ (a log line's reason)."""
    return ", ".join(f for f in a.__dataclass_fields__ if getattr(a, f) != getattr(b, f))
