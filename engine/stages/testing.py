"""Deterministic test stages: configurable text, tone or noise audio, configurable pace.

:class:`TestStage` plays any role (``asr``, ``llm``, ``tts``, and the talker path's
``talker`` and ``codec``) and computes nothing heavy, so it runs as plain asyncio on the
orchestrator loop (pacing with ``asyncio.sleep``; many concurrent requests never queue
behind each other). :class:`engine.stages.testing_batch.BatchTestStage` plays the same
roles on the batching runtime, with these options. Both exist for tests and benchmarks and
are never the default of a config a user runs.

The role is the ``role`` option, or else the stage's name when that is a role name.
"""

from __future__ import annotations

import asyncio
import math
import time
import zlib
from collections import deque
from collections.abc import AsyncIterator, Sequence
from typing import Annotated, ClassVar, Literal

import msgspec
import numpy as np

from duplex_contract.audio import duration_ms
from duplex_contract.batch import AudioOut, TextOut, TranscriptOut
from duplex_contract.errors import ConfigError, StageError
from duplex_contract.tools import TOOL_RESULT_MARK
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
from engine.pipeline.chunkers import Chunker, WindowChunker, WindowOptions
from engine.stages.edges import Edge

#: How many request ids the test stages keep for tests to read back (``submitted``,
#: ``priorities``, ``batches``); beyond it the oldest half is dropped
KEEP_IDS = 4096

Role = Literal["asr", "llm", "tts", "talker", "codec"]
ROLES: dict[str, tuple[Edge, Edge]] = {
    "asr": (Edge.AUDIO, Edge.TEXT),
    "llm": (Edge.TEXT, Edge.TEXT),
    "tts": (Edge.TEXT, Edge.AUDIO),
    "talker": (Edge.TEXT, Edge.CODEC),
    "codec": (Edge.CODEC, Edge.AUDIO),
}


def resolve_role(options: TestStageOptions, stage: str) -> Role:
    role = options.role or stage
    if role not in ROLES:
        raise ConfigError(
            f"engine.stages.{stage}.options.role: the test backend needs a role "
            f"({', '.join(ROLES)}) when the stage is not named after one"
        )
    return role  # type: ignore[return-value]


def word_frame(word: str, frame_size: int) -> tuple[int, ...]:
    """A deterministic codec frame for a word (the test talker's 'codes')."""
    h = zlib.crc32(word.encode())
    return tuple((h >> (i % 4 * 8)) % 256 + 256 * i for i in range(frame_size))


def frame_pcm(frame: Sequence[int], rate: int, ms: float) -> bytes:
    """The test codec's decode of one frame: a tone whose pitch depends on the frame."""
    n = int(rate * ms / 1000)
    hz = 200.0 + 10.0 * (frame[0] % 64)
    t = np.arange(n) / rate
    return (np.sin(2 * math.pi * hz * t) * 6000).astype(np.int16).tobytes()


class TestStageOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    transcript: str | None = None  # ASR: fixed transcript; default describes the audio length
    # ASR: audio shorter than ``short_below_ms`` is heard as this (a backchannel, say)
    short_transcript: str | None = None
    short_below_ms: Annotated[float, msgspec.Meta(ge=0)] = 600.0
    reply: str = "Hello there. This is the deterministic test stage speaking, one word at a time."
    echo: bool = False  # LLM: reply with the last user message instead of ``reply``
    # LLM: reply with every message of the prompt after the system prompt (tool notes
    # included), joined by " | " (tests that inspect what the history put into the prompt)
    echo_prompt: bool = False
    # LLM, scripted function calls: with tools offered, the n-th request (n = tool results
    # already in the prompt) calls ``tool_calls[n]``; past the script it answers with text,
    # unless a call is required (then it calls the first tool offered).
    tool_calls: list[str] = []
    tool_arguments: dict[str, str] = {}  # arguments (JSON text) per function; default "{}"
    token_interval_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    asr_delay_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    audio: Literal["tone", "noise", "silence"] = "tone"
    tone_hz: float = 440.0
    ms_per_word: Annotated[float, msgspec.Meta(gt=0)] = 250.0
    chunk_ms: Annotated[float, msgspec.Meta(gt=0)] = 100.0
    realtime: bool = False  # TTS: emit audio at real-time pace
    voices: tuple[str, ...] = ("test",)  # TTS/talker: the voice names it answers to
    pace: Annotated[float, msgspec.Meta(gt=0)] = 1.0  # >1 = faster than real time
    fail_on: str | None = None  # a request whose text contains this fails (stage_failed)
    crash_on: str | None = None  # ... or kills the "worker" (worker_died)
    hang_on: str | None = None  # ... or never finishes (until aborted)
    load_delay_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    # replicas (by name: llm0, llm1, ...) that report themselves down (health(); /health)
    down_replicas: tuple[str, ...] = ()
    role: Role | None = None  # None: the stage's name (asr, llm, tts, talker or codec)
    frame_size: Annotated[int, msgspec.Meta(ge=1)] = 7  # talker/codec: ids per codec frame
    ms_per_frame: Annotated[float, msgspec.Meta(gt=0)] = 80.0  # codec: audio per frame
    # batching runtime (BatchTestStage): requests per step, simulated compute per step
    max_batch: Annotated[int, msgspec.Meta(ge=1)] = 8
    step_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class _Abort:
    """An abort flag with a cheap interruptible sleep (one timer, no task per sleep)."""

    __slots__ = ("flag", "waiter")

    def __init__(self) -> None:
        self.flag = False
        self.waiter: asyncio.Future[None] | None = None

    def set(self) -> None:
        self.flag = True
        if self.waiter is not None:
            _resolve(self.waiter)

    def is_set(self) -> bool:
        return self.flag

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0 or self.flag:
            return
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self.waiter = fut
        handle = loop.call_later(seconds, _resolve, fut)
        try:
            await fut
        finally:
            handle.cancel()
            self.waiter = None


class TestStage:
    """Implements the StageBackend protocol for ASR, LLM and TTS requests."""

    __test__ = False  # not a pytest class
    Options: ClassVar[type[TestStageOptions]] = TestStageOptions
    device_kinds: ClassVar[frozenset[str]] = frozenset({"cpu"})
    keeps_auto: ClassVar[bool] = False

    def __init__(
        self, options: TestStageOptions, name: str, *, device: str = "cpu", stage: str | None = None
    ) -> None:
        self.options = options
        self.name = name
        self.device = device
        self.role = resolve_role(options, stage or name)
        self.consumes, self.emits = ROLES[self.role]
        self._cancelled: dict[str, _Abort] = {}
        self.restarts = 0
        # what tests read back, all bounded: a soak's server runs this stage for hours (the
        # unbounded id lists grew its RSS ~60 MB/h under the CI soak's load)
        self.submitted: list[str] = []  # request ids as submitted, the last KEEP_IDS
        self.requests: deque[StageRequest] = deque(maxlen=64)  # they carry their audio
        self.priorities: dict[str, int] = {}  # request id -> its Priority, the last KEEP_IDS
        self._rng = np.random.default_rng(1234)
        self.down: str | None = None  # why health() reports it down (tests set it)
        self._tones: dict[tuple[int, float], bytes] = {}

    @classmethod
    def cuda_device_count(cls) -> int:
        return 0

    @property
    def capacity(self) -> int:
        """Request slots the scheduler counts (engine/orchestration/scheduling.py):
        ``max_batch``."""
        return self.options.max_batch

    def health(self) -> str | None:
        """Down when ``down`` is set (tests) or its name is in ``down_replicas``."""
        if self.down is None and self.name in self.options.down_replicas:
            return "test: replica configured down"
        return self.down

    def voices(self) -> tuple[str, ...]:
        return tuple(self.options.voices)

    async def start(self) -> None:
        if self.options.load_delay_s:
            await asyncio.sleep(self.options.load_delay_s)

    async def close(self) -> None:
        for ev in self._cancelled.values():
            ev.set()

    async def abort(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            ev = self._cancelled.get(rid)
            if ev is not None:
                ev.set()

    async def _maybe_hang(self, text: str, cancelled: _Abort) -> None:
        if self.options.hang_on and self.options.hang_on in text:
            while not cancelled.is_set():
                await cancelled.sleep(3600.0)

    def _check_faults(self, text: str) -> None:
        if self.options.fail_on and self.options.fail_on in text:
            raise StageError(f"{self.name}: injected failure", code="stage_failed")
        if self.options.crash_on and self.options.crash_on in text:
            self.restarts += 1
            raise StageError(f"{self.name}: worker died: injected crash", code="worker_died")

    async def submit(self, request: StageRequest) -> AsyncIterator[StageOutput]:
        cancelled = _Abort()
        self._cancelled[request.request_id] = cancelled
        self.submitted.append(request.request_id)
        self.requests.append(request)
        self.priorities[request.request_id] = int(request.priority)
        if len(self.submitted) > KEEP_IDS:
            for rid in self.submitted[: KEEP_IDS // 2]:
                self.priorities.pop(rid, None)
            del self.submitted[: KEEP_IDS // 2]
        try:
            if isinstance(request, AsrRequest):
                gen = self._asr(request, cancelled)
            elif isinstance(request, LlmRequest):
                gen = self._llm(request, cancelled)
            elif isinstance(request, TokensRequest):
                gen = self._codec(request, cancelled)
            elif self.role == "talker":
                gen = self._talker(request, cancelled)
            else:
                gen = self._tts(request, cancelled)
            done = False
            async for out in gen:
                if cancelled.is_set() and not isinstance(out, StageDone):
                    break
                done = done or isinstance(out, StageDone)
                yield out
            if cancelled.is_set() and not done:
                yield StageDone(request_id=request.request_id, finish_reason="aborted")
        finally:
            self._cancelled.pop(request.request_id, None)

    async def _sleep(self, seconds: float, cancelled: _Abort) -> None:
        await cancelled.sleep(seconds)

    async def _asr(self, req: AsrRequest, cancelled: _Abort) -> AsyncIterator[StageOutput]:
        await self._sleep(self.options.asr_delay_s, cancelled)
        ms = duration_ms(len(req.audio), req.sample_rate)
        text = self.options.transcript or f"user audio of {ms:.0f} milliseconds"
        if self.options.short_transcript is not None and ms < self.options.short_below_ms:
            text = self.options.short_transcript
        self._check_faults(text)
        yield TranscriptOut(request_id=req.request_id, text=text, final=True)
        yield StageDone(request_id=req.request_id)

    def _scripted_call(self, req: LlmRequest) -> str | None:
        """The call JSON this request makes (tool_calls / tool_arguments), if any."""
        if not req.tools:
            return None
        done = sum(m.content.count(TOOL_RESULT_MARK) for m in req.messages if m.role == "system")
        offered = {t.name for t in req.tools}
        name = None
        if done < len(self.options.tool_calls) and self.options.tool_calls[done] in offered:
            name = self.options.tool_calls[done]
        elif req.tool_required:
            name = req.tools[0].name
        if name is None:
            return None
        args = self.options.tool_arguments.get(name, "{}")
        return f'{{"name": "{name}", "arguments": {args}}}'

    async def _llm(self, req: LlmRequest, cancelled: _Abort) -> AsyncIterator[StageOutput]:
        last_user = next((m.content for m in reversed(req.messages) if m.role == "user"), "")
        self._check_faults(last_user)
        await self._maybe_hang(last_user, cancelled)
        call = self._scripted_call(req)
        if call is not None:  # streamed in pieces of 8 characters, like tokens
            for i in range(0, len(call), 8):
                await self._sleep(self.options.token_interval_s, cancelled)
                if cancelled.is_set():
                    return
                yield TextOut(request_id=req.request_id, text=call[i : i + 8])
            yield StageDone(request_id=req.request_id, tokens=(len(call) + 7) // 8)
            return
        reply = last_user if self.options.echo else self.options.reply
        if self.options.echo_prompt:
            first_system = bool(req.messages) and req.messages[0].role == "system"
            reply = " | ".join(m.content for m in req.messages[int(first_system) :])
        words = reply.split(" ")
        prompt = sum(len(m.content.split()) for m in req.messages)  # a word is a token here
        n = 0
        for i, word in enumerate(words[: req.max_tokens]):
            await self._sleep(self.options.token_interval_s, cancelled)
            if cancelled.is_set():  # as llama.cpp's stage: the prompt was read all the same
                yield StageDone(
                    request_id=req.request_id,
                    finish_reason="aborted",
                    tokens=n,
                    prompt_tokens=prompt,
                )
                return
            n += 1
            yield TextOut(request_id=req.request_id, text=word if i == 0 else " " + word)
        reason: Literal["stop", "length"] = "length" if len(words) > req.max_tokens else "stop"
        yield StageDone(
            request_id=req.request_id, finish_reason=reason, tokens=n, prompt_tokens=prompt
        )

    def _samples(self, n: int, offset: int, rate: int) -> bytes:
        kind = self.options.audio
        if kind == "silence":
            data = np.zeros(n, dtype=np.int16)
        elif kind == "noise":
            data = (self._rng.standard_normal(n) * 3000).clip(-32000, 32000).astype(np.int16)
        else:
            return self._tone(n, offset, rate)
        return data.tobytes()

    def _tone(self, n: int, offset: int, rate: int) -> bytes:
        """Samples ``offset .. offset + n`` of the tone. A whole-Hz tone repeats every second,
        so it is sliced from a cached 2 s table: the benchmarks run hundreds of these streams,
        and the test stage must not be their cost."""
        hz = self.options.tone_hz
        if n > rate or hz != int(hz):
            t = (np.arange(n) + offset) / rate
            return (np.sin(2 * math.pi * hz * t) * 8000).astype("<i2").tobytes()
        table = self._tones.get((rate, hz))
        if table is None:
            t = np.arange(2 * rate) / rate
            table = (np.sin(2 * math.pi * hz * t) * 8000).astype("<i2").tobytes()
            self._tones[(rate, hz)] = table
        start = 2 * (offset % rate)
        return table[start : start + 2 * n]

    async def _tts(self, req: TtsRequest, cancelled: _Abort) -> AsyncIterator[StageOutput]:
        self._check_faults(req.text)
        words = max(1, len(req.text.split()))
        total_ms = words * self.options.ms_per_word / req.speed
        rate = req.sample_rate
        chunk = max(1, int(rate * self.options.chunk_ms / 1000))
        total = int(rate * total_ms / 1000)
        interval = self.options.chunk_ms / 1000 / self.options.pace
        offset = 0
        while offset < total and not cancelled.is_set():
            n = min(chunk, total - offset)
            pcm = self._samples(n, offset, rate)
            offset += n
            yield AudioOut(
                request_id=req.request_id, pcm=pcm, sample_rate=rate, t_ns=time.monotonic_ns()
            )
            if self.options.realtime:
                await self._sleep(interval, cancelled)
        yield StageDone(request_id=req.request_id)

    async def _talker(self, req: TtsRequest, cancelled: _Abort) -> AsyncIterator[StageOutput]:
        """Text -> one codec frame per word, paced like tokens."""
        self._check_faults(req.text)
        for word in req.text.split():
            await self._sleep(self.options.token_interval_s, cancelled)
            if cancelled.is_set():
                return
            yield TokensOut(
                request_id=req.request_id, ids=word_frame(word, self.options.frame_size)
            )
        yield StageDone(request_id=req.request_id)

    async def _codec(self, req: TokensRequest, cancelled: _Abort) -> AsyncIterator[StageOutput]:
        """Codec frames -> audio, skipping the left-context frames."""
        f = self.options.frame_size
        ids = req.ids[req.context :]
        for i in range(0, len(ids) - len(ids) % f, f):
            if cancelled.is_set():
                return
            pcm = frame_pcm(ids[i : i + f], req.sample_rate, self.options.ms_per_frame)
            yield AudioOut(
                request_id=req.request_id,
                pcm=pcm,
                sample_rate=req.sample_rate,
                t_ns=time.monotonic_ns(),
            )
        yield StageDone(request_id=req.request_id)

    def make_chunker(self) -> Chunker | None:
        if self.role != "codec":
            return None
        return WindowChunker(WindowOptions(frame_size=self.options.frame_size))


__all__ = ["ROLES", "TestStage", "TestStageOptions", "frame_pcm", "resolve_role", "word_frame"]
