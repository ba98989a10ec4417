"""A simulated GPU stage: real-shaped outputs, timing from a cost model, no compute.

``backend: sim`` plays one of four roles (the ``role`` option, or the stage's name):

* ``asr`` (audio -> text) and ``codec`` (codec frames -> audio) make *batched calls*: each
  call takes up to ``max_batch`` waiting requests (real-time first) and lasts
  ``call_ms + item_ms x n`` (or, with ``call_ms_at``, the piecewise-linear curve through
  those measured points, extended along its last segment);
* ``llm`` (text -> text) and ``talker`` (text -> codec frames) *decode continuously*: every
  running request advances one token per step, a step lasts ``step_ms + step_ms_per_seq x
  batch`` plus ``prefill_ms_per_token`` for each prompt token of the requests that joined
  it; at most ``max_num_seqs`` run, and a request joins only while the KV cache
  (``kv_tokens``: its prompt plus all the tokens it will produce) has room, so the rest
  wait in the queue.

One replica's work is serial, as on one GPU: one call or step at a time. Time is kept on
the event loop's clock against a running deadline (each call or step ends its duration
after the previous one ended, or after it began when the stage was idle), so a late wakeup
of the loop does not slow the simulated device down. Nothing burns CPU: waits are
``asyncio`` sleeps on the orchestrator's loop.

Outputs, so that the server, protocol and clients run unchanged: the ASR's ``transcript``;
the LLM's ``reply`` one word per token; the talker's Orpheus-layout codes
(engine/codec_layout.py), one frame of 7 codes per 7 tokens, as many frames as the segment
takes to say at ``ms_per_word``; the codec's silence (or a tone) of the frames each window
emits (85.3 ms each), cut by the same windowing as the real SNAC stage
(:class:`engine.stages.codec_windows.CodecChunker`).

Figures (tests, benchmarks): ``calls`` records ``(batch size, start, end)`` of each call or
step on the loop clock (the last 4096).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal

import msgspec
import numpy as np

from audio_kit.pcm import split_pcm
from duplex_contract.batch import AudioOut, TextOut, TranscriptOut
from duplex_contract.errors import ConfigError, StageError
from engine.codec_layout import ORPHEUS
from engine.messages import (
    AsrRequest,
    LlmRequest,
    StageDone,
    StageOutput,
    StageRequest,
    TokensOut,
    TokensRequest,
    TtsRequest,
)
from engine.stages.codec_windows import CodecChunker
from engine.stages.edges import Edge

Role = Literal["asr", "llm", "talker", "codec"]
ROLES: dict[str, tuple[Edge, Edge]] = {
    "asr": (Edge.AUDIO, Edge.TEXT),
    "llm": (Edge.TEXT, Edge.TEXT),
    "talker": (Edge.TEXT, Edge.CODEC),
    "codec": (Edge.CODEC, Edge.AUDIO),
}
NonNeg = Annotated[float, msgspec.Meta(ge=0)]
Positive = Annotated[int, msgspec.Meta(ge=1)]
_KEEP = 4096


class SimOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    role: Role | None = None  # None: the stage's name
    # batched calls (asr, codec): call ms = call_ms + item_ms x items, or the curve through
    # call_ms_at {items: ms} when given
    call_ms: NonNeg = 0.0
    item_ms: NonNeg = 0.0
    call_ms_at: dict[Positive, NonNeg] = {}
    max_batch: Positive = 16
    # continuous batching (llm, talker): step ms = step_ms + step_ms_per_seq x batch
    step_ms: NonNeg = 0.0
    step_ms_per_seq: NonNeg = 0.0
    prefill_ms_per_token: NonNeg = 0.0
    max_num_seqs: Positive = 64
    kv_tokens: Positive = 1_000_000
    # what it says
    transcript: str = "what is the weather like today"
    reply: str = (
        "Today looks mild and mostly sunny, with a light breeze in the afternoon. "
        "Take a jacket if you go out after dark."
    )
    ms_per_word: Annotated[float, msgspec.Meta(gt=0)] = 330.0  # talker: speech per word
    audio: Literal["silence", "tone"] = "silence"  # codec output
    chunk_ms: Annotated[float, msgspec.Meta(ge=10)] = 100.0
    # codec windowing (as the real SNAC stage's options)
    first_frames: Positive = 2
    window_frames: Positive = 8
    context_frames: Annotated[int, msgspec.Meta(ge=0)] = 3
    lookahead_frames: Annotated[int, msgspec.Meta(ge=0)] = 3


def call_cost_ms(o: SimOptions, n: int) -> float:
    """How long one batched call of ``n`` items lasts (ms)."""
    if not o.call_ms_at:
        return o.call_ms + o.item_ms * n
    pts = sorted(o.call_ms_at.items())
    if n <= pts[0][0]:
        return pts[0][1]
    if len(pts) == 1:  # one point: proportional beyond it
        return pts[0][1] * n / pts[0][0]
    for (x0, y0), (x1, y1) in itertools.pairwise(pts):
        if n <= x1:
            return y0 + (y1 - y0) * (n - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = pts[-2], pts[-1]  # beyond the last point: along the last segment
    return y1 + (y1 - y0) * (n - x1) / (x1 - x0)


def step_cost_ms(o: SimOptions, batch: int, prefill_tokens: int = 0) -> float:
    """How long one decode step over ``batch`` requests lasts (ms), with the prefill of
    ``prefill_tokens`` prompt tokens of the requests that joined it."""
    return o.step_ms + o.step_ms_per_seq * batch + o.prefill_ms_per_token * prefill_tokens


@dataclass(eq=False)
class _Req:
    request: StageRequest
    out: asyncio.Queue[StageOutput | None]
    plan: list[Any]  # what it still has to emit, one entry per token / one per call
    prompt: int = 0
    cost: int = 0  # KV tokens it holds while it runs
    started: bool = False
    aborted: bool = False
    tokens: int = 0
    queued_at: float = 0.0  # loop clock


@dataclass
class _Queue:
    heap: list[tuple[int, int, _Req]] = field(default_factory=list)
    seq: itertools.count[int] = field(default_factory=itertools.count)

    def push(self, r: _Req) -> None:
        heapq.heappush(self.heap, (int(r.request.priority), next(self.seq), r))


def _words(text: str) -> int:
    return max(1, len(text.split()))


class SimStage:
    """Implements the StageBackend protocol (see the module docstring)."""

    Options: ClassVar[type[SimOptions]] = SimOptions
    device_kinds: ClassVar[frozenset[str]] = frozenset({"cpu"})
    keeps_auto: ClassVar[bool] = False
    restarts: int = 0  # nothing to restart: it is a cost model on the loop

    def __init__(
        self, options: SimOptions, name: str, *, device: str = "cpu", stage: str | None = None
    ) -> None:
        self.options = options
        self.name = name
        self.device = device
        role = options.role or stage or name
        if role not in ROLES:
            raise ConfigError(
                f"engine.stages.{stage or name}.options.role: the sim backend needs a role "
                f"({', '.join(ROLES)}) when the stage is not named after one"
            )
        self.role: Role = role  # type: ignore[assignment]
        self.consumes, self.emits = ROLES[self.role]
        self.max_batch = options.max_batch if self.batched else options.max_num_seqs
        self.layout = ORPHEUS
        self._waiting = _Queue()
        self._running: list[_Req] = []
        self._by_id: dict[str, _Req] = {}
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._deadline = 0.0
        self.kv_used = 0
        self.calls: deque[tuple[int, float, float]] = deque(maxlen=_KEEP)
        # figures for /metrics (wired by the stage pool): batch size of each call or step,
        # and each request's wait in the queue before its first one
        self.on_step: Callable[[int], None] | None = None
        self.on_wait: Callable[[float], None] | None = None
        self._zeros: bytes = b""

    @property
    def batched(self) -> bool:
        return self.role in ("asr", "codec")

    @property
    def capacity(self) -> int:
        """Request slots (engine/orchestration/scheduling.py): items per call, or sequences per
        step."""
        return self.max_batch

    @classmethod
    def cuda_device_count(cls) -> int:
        return 0

    def make_chunker(self) -> CodecChunker | None:
        if self.role != "codec":
            return None
        o = self.options
        return CodecChunker(
            self.layout.frame_size,
            o.first_frames,
            o.window_frames,
            o.context_frames,
            o.lookahead_frames,
        )

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._serve(), name=f"sim:{self.name}")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        for r in [*self._by_id.values()]:
            self._end(r, aborted=True)

    async def abort(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            r = self._by_id.get(rid)
            if r is not None:
                r.aborted = True
                self._end(r, aborted=True)

    async def submit(self, request: StageRequest) -> AsyncIterator[StageOutput]:
        if self._task is None or self._wake is None:
            raise StageError(f"{self.name}: not started", code="stage_failed")
        r = self._plan(request)
        r.queued_at = asyncio.get_running_loop().time()
        self._by_id[request.request_id] = r
        self._waiting.push(r)
        self._wake.set()
        try:
            while (item := await r.out.get()) is not None:
                yield item
        finally:
            if not r.aborted and request.request_id in self._by_id:
                r.aborted = True  # the consumer went away: leave at the next step
                self._end(r, aborted=True)

    # ------------------------------------------------------------------ what a request makes
    def _plan(self, request: StageRequest) -> _Req:
        o = self.options
        q: asyncio.Queue[StageOutput | None] = asyncio.Queue()
        if self.role == "asr":
            if not isinstance(request, AsrRequest):
                raise StageError(f"{self.name}: expected an AsrRequest")
            return _Req(request, q, [o.transcript])
        if self.role == "codec":
            if not isinstance(request, TokensRequest):
                raise StageError(f"{self.name}: expected a TokensRequest")
            f = self.layout.frame_size
            frames = len(request.ids) // f
            emit_from = request.context // f
            emit_to = frames if request.final else max(emit_from, frames - o.lookahead_frames)
            return _Req(request, q, [emit_to - emit_from])
        if self.role == "llm":
            if not isinstance(request, LlmRequest):
                raise StageError(f"{self.name}: expected an LlmRequest")
            words = o.reply.split(" ")[: request.max_tokens]
            plan: list[Any] = [w if i == 0 else " " + w for i, w in enumerate(words)]
            prompt = sum(math.ceil(len(m.content) / 4) + 4 for m in request.messages)
            return _Req(request, q, plan, prompt=prompt, cost=prompt + len(plan))
        if not isinstance(request, TtsRequest):
            raise StageError(f"{self.name}: expected a TtsRequest")
        frames = max(1, round(_words(request.text) * o.ms_per_word / self.layout.frame_ms))
        f = self.layout.frame_size
        tokens = frames * f
        prompt = math.ceil(len(request.text) / 4) + 8
        codes = [(i // f * 37 + i % f * 11) % self.layout.codebook_size for i in range(tokens)]
        return _Req(request, q, codes, prompt=prompt, cost=prompt + tokens)

    # ------------------------------------------------------------------ the device
    async def _serve(self) -> None:
        assert self._wake is not None
        loop = asyncio.get_running_loop()
        while True:
            self._admit()
            if not self._running:
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = self._running if not self.batched else self._running[: self.max_batch]
            joined = [r for r in batch if not r.started]
            now = loop.time()
            for r in joined:
                r.started = True
                if self.on_wait is not None:
                    self.on_wait(max(0.0, max(now, self._deadline) - r.queued_at))
            if self.batched:
                ms = call_cost_ms(self.options, len(batch))
            else:
                ms = step_cost_ms(self.options, len(batch), sum(r.prompt for r in joined))
            start = max(loop.time(), self._deadline)
            self._deadline = start + ms / 1000
            await asyncio.sleep(max(0.0, self._deadline - loop.time()))
            self.calls.append((len(batch), start, self._deadline))
            if self.on_step is not None:
                self.on_step(len(batch))
            for r in list(batch):
                if not r.aborted:
                    self._advance(r)

    def _admit(self) -> None:
        """Move waiting requests in (real-time first) while there is room."""
        heap = self._waiting.heap
        limit = self.options.max_batch if self.batched else self.options.max_num_seqs
        while heap:
            r = heap[0][2]
            if r.aborted:
                heapq.heappop(heap)
                continue
            if self.batched:
                if len(self._running) >= limit:
                    return
            elif len(self._running) >= limit or (
                self._running and self.kv_used + r.cost > self.options.kv_tokens
            ):
                return
            heapq.heappop(heap)
            self.kv_used += r.cost
            self._running.append(r)

    def _advance(self, r: _Req) -> None:
        rid = r.request.request_id
        if self.role == "asr":
            r.out.put_nowait(TranscriptOut(request_id=rid, text=r.plan[0], final=True))
            self._end(r)
        elif self.role == "codec":
            self._emit_audio(r, r.plan[0])
            self._end(r)
        elif self.role == "llm":
            r.out.put_nowait(TextOut(request_id=rid, text=r.plan[r.tokens]))
            r.tokens += 1
            if r.tokens >= len(r.plan):
                self._end(r)
        else:  # talker: one token a step; a frame's codes go out when it is whole
            r.tokens += 1
            f = self.layout.frame_size
            if r.tokens % f == 0:
                codes = tuple(r.plan[r.tokens - f : r.tokens])
                r.out.put_nowait(TokensOut(request_id=rid, ids=codes))
            if r.tokens >= len(r.plan):
                self._end(r)

    def _emit_audio(self, r: _Req, frames: int) -> None:
        req = r.request
        assert isinstance(req, TokensRequest)
        rate = req.sample_rate
        n = round(frames * self.layout.samples_per_frame * rate / self.layout.sample_rate)
        if self.options.audio == "tone":
            t = np.arange(n) / rate
            pcm = (np.sin(2 * math.pi * 220.0 * t) * 4000).astype("<i2").tobytes()
        else:
            if len(self._zeros) < 2 * n:
                self._zeros = bytes(2 * n)
            pcm = self._zeros[: 2 * n]
        t_ns = time.monotonic_ns()
        for piece in split_pcm(pcm, rate, self.options.chunk_ms) if pcm else []:
            r.out.put_nowait(
                AudioOut(request_id=req.request_id, pcm=piece, sample_rate=rate, t_ns=t_ns)
            )

    def _end(self, r: _Req, aborted: bool = False) -> None:
        if self._by_id.pop(r.request.request_id, None) is None:
            return
        if r in self._running:
            self._running.remove(r)
            self.kv_used -= r.cost
        rid = r.request.request_id
        if aborted:
            r.out.put_nowait(StageDone(request_id=rid, finish_reason="aborted"))
        elif isinstance(r.request, LlmRequest):
            words = len(self.options.reply.split(" "))
            reason: Literal["stop", "length"] = "length" if words > r.request.max_tokens else "stop"
            r.out.put_nowait(
                StageDone(
                    request_id=rid, finish_reason=reason, tokens=r.tokens, prompt_tokens=r.prompt
                )
            )
        else:
            r.out.put_nowait(StageDone(request_id=rid, tokens=r.tokens, prompt_tokens=r.prompt))
        r.out.put_nowait(None)
        if self._wake is not None:
            self._wake.set()


__all__ = ["SimOptions", "SimStage", "call_cost_ms", "step_cost_ms"]
