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

The costs may come from a cost file (``cost_file``, its entry ``cost_key``;
engine/stages/sim_costs.py): a cost there applies where these options keep their default.

The device (engine/stages/sim_device.py): a replica on ``cuda:N`` shares that simulated
device with every other sim replica placed there, so a call or step of one stage occupies
it and the others wait (one GPU carrying the whole route); a replica on ``cpu`` has a
device of its own (every stage in parallel, as on separate GPUs). Waits are ``asyncio``
sleeps on the orchestrator's loop against the device's running deadline, so a late wakeup
of the loop does not slow the simulated device down. Nothing burns CPU, except the
optional host cost per item (``host_us_per_item``: per token, window or utterance), burned
for real in a worker thread of this process before the step's outputs are delivered (the
output handling a real engine process does beside the device).

Outputs, so that the server, protocol and clients run unchanged: the ASR's transcript (the
``transcript`` option, or with ``transcript: null`` words that depend on the audio it got,
engine/stages/sim_plans.py); the LLM's reply one word per token (``reply``, or with
``reply: null`` a reply that depends on the prompt); the talker's Orpheus-layout codes
(engine/codec_layout.py), one frame of 7 codes per 7 tokens, as many frames as the segment
takes to say at ``ms_per_word`` (at most ``max_frames``); the codec's silence (or a tone) of
the frames each window emits (85.3 ms each), cut by the same windowing as the real SNAC
stage (:class:`engine.stages.codec_windows.CodecChunker`).

Figures (tests, benchmarks, the scheduler): ``calls`` records ``(batch size, start, end)``
of each call or step on the loop clock (the last 4096); a decode stage reports its ``pace``
(engine/stage_figures.py: tokens per second each running request gets, against the rate
its output plays at: the talker's frames, the LLM's words at ``ms_per_word``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import heapq
import itertools
import math
import statistics
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Annotated, ClassVar, Literal

import msgspec
import numpy as np

from audio_kit.pcm import split_pcm
from duplex_contract.batch import AudioOut, TextOut, TranscriptOut
from duplex_contract.errors import ConfigError, StageError
from engine.codec_layout import ORPHEUS
from engine.messages import (
    LlmRequest,
    StageDone,
    StageOutput,
    StageRequest,
    TokensOut,
    TokensRequest,
)
from engine.stage_figures import Pace, StageEngineFigures
from engine.stages.codec_windows import CodecChunker
from engine.stages.edges import Edge
from engine.stages.sim_costs import load_costs
from engine.stages.sim_device import SimDevice, burn, device_for
from engine.stages.sim_plans import SimQueue, SimRequest, make_plan

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
SIM_GPUS = 8  # simulated devices a config may place sim replicas on (cuda:0 .. cuda:7)
_PACE_STEPS = 24  # the pace is measured over the last steps ...
_IDLE_GAP_S = 0.2  # ... leaving out the gaps where the stage had nothing to run


class SimOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    role: Role | None = None  # None: the stage's name
    # costs from a cost file (engine/stages/sim_costs.py), entry cost_key (None: the role)
    cost_file: str | None = None
    cost_key: str | None = None
    # batched calls (asr, codec): call ms = call_ms + item_ms x items, or the curve through
    # call_ms_at {items: ms} when given
    call_ms: NonNeg = 0.0
    item_ms: NonNeg = 0.0
    call_ms_at: dict[Positive, NonNeg] = {}
    max_batch: Positive = 16
    gather_ms: NonNeg = 0.0  # a call waits this long after its first request for others
    # continuous batching (llm, talker): step ms = step_ms + step_ms_per_seq x batch
    step_ms: NonNeg = 0.0
    step_ms_per_seq: NonNeg = 0.0
    prefill_ms_per_token: NonNeg = 0.0
    max_num_seqs: Positive = 64
    kv_tokens: Positive = 1_000_000
    # host CPU per token (llm, talker), window (codec) or utterance (asr), burned for real
    host_us_per_item: NonNeg = 0.0
    # what it says: a fixed transcript / reply, or (null) one that depends on its input
    transcript: str | None = "what is the weather like today"
    words_per_s: Annotated[float, msgspec.Meta(gt=0)] = 2.5  # transcript: null
    reply: str | None = (
        "Today looks mild and mostly sunny, with a light breeze in the afternoon. "
        "Take a jacket if you go out after dark."
    )
    reply_words: tuple[Positive, Positive] = (12, 28)  # reply: null
    ms_per_word: Annotated[float, msgspec.Meta(gt=0)] = 330.0  # talker: speech per word
    max_frames: Positive | None = None  # talker: per segment
    audio: Literal["silence", "tone"] = "silence"  # codec output
    chunk_ms: Annotated[float, msgspec.Meta(ge=10)] = 100.0
    # codec windowing (as the real SNAC stage's options)
    first_frames: Positive = 2
    window_frames: Positive = 8
    context_frames: Annotated[int, msgspec.Meta(ge=0)] = 3
    lookahead_frames: Annotated[int, msgspec.Meta(ge=0)] = 3


def with_costs(options: SimOptions, role: str, where: str) -> SimOptions:
    """``options`` with the costs of its cost file applied where it keeps the default."""
    if options.cost_file is None:
        return options
    costs = load_costs(options.cost_file, where=f"{where}.options.cost_file")
    key = options.cost_key or role
    entry = costs.stages.get(key)
    if entry is None:
        raise ConfigError(
            f"{where}.options.cost_key: {options.cost_file} has no stage {key!r} "
            f"(it has: {', '.join(costs.stages)})"
        )
    mine, default = msgspec.structs.asdict(options), msgspec.structs.asdict(SimOptions())
    keep = {k: v for k, v in entry.options().items() if mine[k] == default[k]}
    return msgspec.structs.replace(options, **keep)


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


class SimStage:
    """Implements the StageBackend protocol (see the module docstring)."""

    Options: ClassVar[type[SimOptions]] = SimOptions
    device_kinds: ClassVar[frozenset[str]] = frozenset({"cpu", "cuda"})
    keeps_auto: ClassVar[bool] = False
    restarts: int = 0  # nothing to restart: it is a cost model on the loop

    def __init__(
        self, options: SimOptions, name: str, *, device: str = "cpu", stage: str | None = None
    ) -> None:
        self.name = name
        self.device = device
        role = options.role or stage or name
        if role not in ROLES:
            raise ConfigError(
                f"engine.stages.{stage or name}.options.role: the sim backend needs a role "
                f"({', '.join(ROLES)}) when the stage is not named after one"
            )
        self.role: Role = role  # type: ignore[assignment]
        self.options = options = with_costs(options, role, f"engine.stages.{stage or name}")
        self.consumes, self.emits = ROLES[self.role]
        self.max_batch = options.max_batch if self.batched else options.max_num_seqs
        self.layout = ORPHEUS
        self._waiting = SimQueue()
        self._running: list[SimRequest] = []
        self._by_id: dict[str, SimRequest] = {}
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.clock: SimDevice | None = None  # its device, from start()
        self._host: concurrent.futures.ThreadPoolExecutor | None = None
        self.kv_used = 0
        self.busy_s = 0.0  # device time of its calls and steps
        self.prompt_tokens = self.generated_tokens = 0
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
        return SIM_GPUS  # simulated devices: no CUDA needed

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

    def pace(self) -> Pace | None:
        """Tokens per second each running request gets (the mean step period over the last
        steps, idle gaps left out) against the rate its output plays at; ``limit``: the most
        requests a step serves within that period by the cost model, alone on a device."""
        if self.batched or not self._running or len(self.calls) < 3:
            return None
        o = self.options
        if self.role == "talker":
            need = 1000.0 / self.layout.frame_ms * self.layout.frame_size
        else:
            need = 1000.0 / o.ms_per_word  # one word per token
        recent = list(itertools.islice(reversed(self.calls), _PACE_STEPS))
        gaps = [a[1] - b[1] for a, b in itertools.pairwise(recent)]
        busy = [g for g in gaps if 0 < g < _IDLE_GAP_S]
        if not busy:
            return None
        rate = 1.0 / statistics.fmean(busy)
        limit = 0
        if o.step_ms_per_seq > 0:
            limit = max(1, int((1000.0 / need - o.step_ms) / o.step_ms_per_seq))
        return Pace(streams=len(self._running), rate=rate, need=need, limit=limit)

    def engine_figures(self) -> StageEngineFigures:
        """For ``/metrics``: its queue and running set, KV use, tokens, device time."""
        return StageEngineFigures(
            running=len(self._running),
            waiting=len(self._waiting.heap),
            kv_cache_usage=self.kv_used / self.options.kv_tokens,
            prompt_tokens=self.prompt_tokens,
            generated_tokens=self.generated_tokens,
            busy_s=self.busy_s,
        )

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.clock = device_for(self.device, self.name)
        if self.options.host_us_per_item > 0:
            self._host = concurrent.futures.ThreadPoolExecutor(1, f"sim-host-{self.name}")
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._serve(), name=f"sim:{self.name}")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._host is not None:
            self._host.shutdown(wait=True, cancel_futures=True)
            self._host = None
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

    def _plan(self, request: StageRequest) -> SimRequest:
        try:
            return make_plan(self.role, self.options, self.layout, request)
        except TypeError as exc:
            raise StageError(f"{self.name}: {exc}") from None

    # ------------------------------------------------------------------ the device
    async def _serve(self) -> None:
        assert self._wake is not None and self.clock is not None
        loop = asyncio.get_running_loop()
        ready = loop.time()  # when its next call or step could start (loop clock)
        while True:
            self._admit()
            if not self._running:
                self._wake.clear()
                await self._wake.wait()
                ready = loop.time()
                continue
            if self.batched and self.options.gather_ms and len(self._running) < self.max_batch:
                first = min(r.queued_at for r in self._running)
                ready = max(ready, first + self.options.gather_ms / 1000)
                await asyncio.sleep(max(0.0, ready - loop.time()))
                self._admit()
            async with self.clock.turn():
                self._admit()  # what came while it waited for the device joins too
                batch = self._running if not self.batched else self._running[: self.max_batch]
                if not batch:
                    continue
                joined = [r for r in batch if not r.started]
                if self.batched:
                    ms = call_cost_ms(self.options, len(batch))
                else:
                    ms = step_cost_ms(self.options, len(batch), sum(r.prompt for r in joined))
                start = max(ready, self.clock.free_at)
                for r in joined:
                    r.started = True
                    if self.on_wait is not None:
                        self.on_wait(max(0.0, start - r.queued_at))
                start, ready = await self.clock.occupy(self.name, ready, ms)
            self.calls.append((len(batch), start, ready))
            self.busy_s += ready - start
            if not self.batched:
                self.generated_tokens += len(batch)
                self.prompt_tokens += sum(r.prompt for r in joined)
            if self.on_step is not None:
                self.on_step(len(batch))
            out: list[tuple[SimRequest, StageOutput | None]] = []
            for r in list(batch):
                if not r.aborted:
                    self._advance(r, out)
            if self._host is not None:
                seconds = self.options.host_us_per_item * len(batch) / 1e6
                done = loop.run_in_executor(self._host, burn, seconds)
                done.add_done_callback(functools.partial(_delivered, out))
            else:
                _deliver(out)

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

    def _advance(self, r: SimRequest, out: list[tuple[SimRequest, StageOutput | None]]) -> None:
        """One call or step of ``r``: its outputs into ``out`` (delivered in order)."""
        rid = r.request.request_id
        if self.role == "asr":
            out.append((r, TranscriptOut(request_id=rid, text=r.plan[0], final=True)))
            self._finish(r, out)
        elif self.role == "codec":
            self._emit_audio(r, r.plan[0], out)
            self._finish(r, out)
        elif self.role == "llm":
            out.append((r, TextOut(request_id=rid, text=r.plan[r.tokens])))
            r.tokens += 1
            if r.tokens >= len(r.plan):
                self._finish(r, out)
        else:  # talker: one token a step; a frame's codes go out when it is whole
            r.tokens += 1
            f = self.layout.frame_size
            if r.tokens % f == 0:
                codes = tuple(r.plan[r.tokens - f : r.tokens])
                out.append((r, TokensOut(request_id=rid, ids=codes)))
            if r.tokens >= len(r.plan):
                self._finish(r, out)

    def _emit_audio(
        self, r: SimRequest, frames: int, out: list[tuple[SimRequest, StageOutput | None]]
    ) -> None:
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
            out.append(
                (r, AudioOut(request_id=req.request_id, pcm=piece, sample_rate=rate, t_ns=t_ns))
            )

    def _leave(self, r: SimRequest) -> bool:
        """Take ``r`` off the stage (its KV freed); False if it had left already."""
        if self._by_id.pop(r.request.request_id, None) is None:
            return False
        if r in self._running:
            self._running.remove(r)
            self.kv_used -= r.cost
        if self._wake is not None:
            self._wake.set()
        return True

    def _finish(self, r: SimRequest, out: list[tuple[SimRequest, StageOutput | None]]) -> None:
        """``r`` made its last output: it leaves now; its end goes out after its outputs."""
        if not self._leave(r):
            return
        rid = r.request.request_id
        if isinstance(r.request, LlmRequest):
            reason: Literal["stop", "length"] = "length" if r.cut else "stop"
            done = StageDone(
                request_id=rid, finish_reason=reason, tokens=r.tokens, prompt_tokens=r.prompt
            )
        else:
            done = StageDone(request_id=rid, tokens=r.tokens, prompt_tokens=r.prompt)
        out.extend(((r, done), (r, None)))

    def _end(self, r: SimRequest, aborted: bool = False) -> None:
        """``r`` is aborted (or the stage closes): it ends now."""
        if self._leave(r):
            r.out.put_nowait(StageDone(request_id=r.request.request_id, finish_reason="aborted"))
            r.out.put_nowait(None)


def _deliver(out: list[tuple[SimRequest, StageOutput | None]]) -> None:
    for r, item in out:
        r.out.put_nowait(item)


def _delivered(out: list[tuple[SimRequest, StageOutput | None]], _: object) -> None:
    _deliver(out)


__all__ = ["SIM_GPUS", "SimOptions", "SimStage", "call_cost_ms", "step_cost_ms", "with_costs"]
