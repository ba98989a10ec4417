"""What the sim stages say (engine/stages/sim.py): outputs that depend on their input.

So that a guess is wrong the way a real one is, the simulated ASR's words depend on the
audio it got (a guess on the first half of an utterance hears other words than the whole),
and the simulated LLM's reply on the prompt it got (an answer to other words is another
answer). Both are deterministic: the same audio always gives the same transcript, the same
prompt the same reply. The words come from a fixed vocabulary, picked by a hash of the
input; their number follows the input's length (the ASR: ``words_per_s`` of audio) or a
range (the LLM: sentences of 5-11 words, ``reply_words`` in all).
"""

from __future__ import annotations

import asyncio
import hashlib
import heapq
import itertools
import math
import random
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.codec_layout import CodecLayout
from engine.messages import (
    AsrRequest,
    LlmRequest,
    StageOutput,
    StageRequest,
    TokensRequest,
    TtsRequest,
)

VOCAB = (
    "the weather looks mild today with a light breeze and some sun in the afternoon "
    "take a jacket if you go out after dark the train leaves at nine from the north "
    "platform and the trip takes about an hour so bring something to read our team "
    "meets on monday to plan the week and friday to look back at what went well"
).split()


def _rng(data: bytes) -> random.Random:
    return random.Random(hashlib.blake2b(data, digest_size=8).digest())


def transcript_of(audio: bytes, sample_rate: int, words_per_s: float) -> str:
    """The words a simulated ASR hears in ``audio`` (PCM16): as many as its length holds at
    ``words_per_s``, picked by a hash of the audio."""
    seconds = len(audio) / 2 / max(1, sample_rate)
    n = max(1, round(seconds * words_per_s))
    rng = _rng(audio)
    return " ".join(rng.choice(VOCAB) for _ in range(n))


def reply_of(prompt: str, words: tuple[int, int]) -> list[str]:
    """A simulated reply to ``prompt``, one entry per token (a word, with its space and its
    sentence's full stop): ``words`` (low, high) words in sentences of 5-11."""
    rng = _rng(prompt.encode())
    total = rng.randint(*words)
    out: list[str] = []
    left = 0
    for i in range(total):
        if left == 0:
            left = rng.randint(5, 11)
        word = rng.choice(VOCAB)
        if not out or out[-1].endswith("."):
            word = word.capitalize()
        left -= 1
        if left == 0 or i == total - 1:
            word += "."
        out.append(word if i == 0 else " " + word)
    return out


class PlanOptions(Protocol):
    """What the plans read of the sim stage's options (engine/stages/sim.py SimOptions)."""

    @property
    def transcript(self) -> str | None: ...
    @property
    def words_per_s(self) -> float: ...
    @property
    def reply(self) -> str | None: ...
    @property
    def reply_words(self) -> tuple[int, int]: ...
    @property
    def ms_per_word(self) -> float: ...
    @property
    def max_frames(self) -> int | None: ...
    @property
    def lookahead_frames(self) -> int: ...


@dataclass(eq=False)
class SimRequest:
    """One request on a sim stage, from its plan to its end."""

    request: StageRequest
    out: asyncio.Queue[StageOutput | None]
    plan: list[Any]  # what it emits: one entry per token, or one per call
    prompt: int = 0
    cost: int = 0  # KV tokens it holds while it runs
    cut: bool = False  # its reply was cut at max_tokens
    started: bool = False
    aborted: bool = False
    tokens: int = 0
    queued_at: float = 0.0  # loop clock


@dataclass
class SimQueue:
    """Requests waiting for a sim stage, by priority, then in arrival order."""

    heap: list[tuple[int, int, SimRequest]] = field(default_factory=list)
    seq: itertools.count[int] = field(default_factory=itertools.count)

    def push(self, r: SimRequest) -> None:
        heapq.heappush(self.heap, (int(r.request.priority), next(self.seq), r))


def make_plan(role: str, o: PlanOptions, layout: CodecLayout, request: StageRequest) -> SimRequest:
    """What ``request`` makes on a sim stage playing ``role`` (TypeError: a request that
    role does not take)."""
    q: asyncio.Queue[StageOutput | None] = asyncio.Queue()
    if role == "asr":
        if not isinstance(request, AsrRequest):
            raise TypeError("expected an AsrRequest")
        text = o.transcript
        if text is None:
            text = transcript_of(request.audio, request.sample_rate, o.words_per_s)
        return SimRequest(request, q, [text])
    if role == "codec":
        if not isinstance(request, TokensRequest):
            raise TypeError("expected a TokensRequest")
        f = layout.frame_size
        frames = len(request.ids) // f
        emit_from = request.context // f
        emit_to = frames if request.final else max(emit_from, frames - o.lookahead_frames)
        return SimRequest(request, q, [emit_to - emit_from])
    if role == "llm":
        if not isinstance(request, LlmRequest):
            raise TypeError("expected an LlmRequest")
        if o.reply is not None:
            words = o.reply.split(" ")
            plan: list[Any] = [w if i == 0 else " " + w for i, w in enumerate(words)]
        else:
            plan = reply_of("\n".join(m.content for m in request.messages), o.reply_words)
        cut = len(plan) > request.max_tokens
        plan = plan[: request.max_tokens]
        prompt = sum(math.ceil(len(m.content) / 4) + 4 for m in request.messages)
        return SimRequest(request, q, plan, prompt=prompt, cost=prompt + len(plan), cut=cut)
    if not isinstance(request, TtsRequest):
        raise TypeError("expected a TtsRequest")
    n_words = max(1, len(request.text.split()))
    frames = max(1, round(n_words * o.ms_per_word / layout.frame_ms))
    if o.max_frames is not None:
        frames = min(frames, o.max_frames)
    f = layout.frame_size
    tokens = frames * f
    prompt = math.ceil(len(request.text) / 4) + 8
    codes = [(i // f * 37 + i % f * 11) % layout.codebook_size for i in range(tokens)]
    return SimRequest(request, q, codes, prompt=prompt, cost=prompt + tokens)


__all__ = [
    "VOCAB",
    "PlanOptions",
    "SimQueue",
    "SimRequest",
    "make_plan",
    "reply_of",
    "transcript_of",
]
