"""A deterministic test stage: configurable text, tone or noise audio, configurable pace.

It serves any stage kind (ASR, LLM, TTS) and computes nothing heavy, so it runs as plain
asyncio on the orchestrator loop (pacing with ``asyncio.sleep``; many concurrent requests
never queue behind each other). It exists for tests and benchmarks and is never the default
of a config a user runs.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Sequence
from typing import Annotated, ClassVar, Literal

import msgspec
import numpy as np

from engine.errors import StageError
from engine.messages import (
    AsrRequest,
    AudioOut,
    LlmRequest,
    StageDone,
    StageOutput,
    StageRequest,
    TextOut,
    TranscriptOut,
    TtsRequest,
)
from engine.stages.base import WorkerCrash


class TestStageOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    transcript: str | None = None  # ASR: fixed transcript; default describes the audio length
    reply: str = "Hello there. This is the deterministic test stage speaking, one word at a time."
    echo: bool = False  # LLM: reply with the last user message instead of ``reply``
    token_interval_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    asr_delay_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    audio: Literal["tone", "noise", "silence"] = "tone"
    tone_hz: float = 440.0
    ms_per_word: Annotated[float, msgspec.Meta(gt=0)] = 250.0
    chunk_ms: Annotated[float, msgspec.Meta(gt=0)] = 100.0
    realtime: bool = False  # TTS: emit audio at real-time pace
    pace: Annotated[float, msgspec.Meta(gt=0)] = 1.0  # >1 = faster than real time
    fail_on: str | None = None  # a request whose text contains this fails (stage_failed)
    crash_on: str | None = None  # ... or kills the "worker" (worker_died)
    hang_on: str | None = None  # ... or never finishes (until aborted)
    load_delay_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0


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

    def __init__(self, options: TestStageOptions, name: str) -> None:
        self.options = options
        self.name = name
        self._cancelled: dict[str, _Abort] = {}
        self.restarts = 0
        self.submitted: list[str] = []
        self._rng = np.random.default_rng(1234)

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
        try:
            if isinstance(request, AsrRequest):
                gen = self._asr(request, cancelled)
            elif isinstance(request, LlmRequest):
                gen = self._llm(request, cancelled)
            else:
                gen = self._tts(request, cancelled)
            async for out in gen:
                if cancelled.is_set():
                    break
                yield out
            if cancelled.is_set():
                yield StageDone(request_id=request.request_id, finish_reason="aborted")
        finally:
            self._cancelled.pop(request.request_id, None)

    async def _sleep(self, seconds: float, cancelled: _Abort) -> None:
        await cancelled.sleep(seconds)

    async def _asr(self, req: AsrRequest, cancelled: _Abort) -> AsyncIterator[StageOutput]:
        await self._sleep(self.options.asr_delay_s, cancelled)
        ms = len(req.audio) / 2 / req.sample_rate * 1000
        text = self.options.transcript or f"user audio of {ms:.0f} milliseconds"
        self._check_faults(text)
        yield TranscriptOut(request_id=req.request_id, text=text, final=True)
        yield StageDone(request_id=req.request_id)

    async def _llm(self, req: LlmRequest, cancelled: _Abort) -> AsyncIterator[StageOutput]:
        last_user = next((m.content for m in reversed(req.messages) if m.role == "user"), "")
        self._check_faults(last_user)
        await self._maybe_hang(last_user, cancelled)
        reply = last_user if self.options.echo else self.options.reply
        words = reply.split(" ")
        n = 0
        for i, word in enumerate(words[: req.max_tokens]):
            await self._sleep(self.options.token_interval_s, cancelled)
            if cancelled.is_set():
                return
            n += 1
            yield TextOut(request_id=req.request_id, text=word if i == 0 else " " + word)
        reason: Literal["stop", "length"] = "length" if len(words) > req.max_tokens else "stop"
        yield StageDone(request_id=req.request_id, finish_reason=reason, tokens=n)

    def _samples(self, n: int, offset: int, rate: int) -> bytes:
        kind = self.options.audio
        if kind == "silence":
            data = np.zeros(n, dtype=np.int16)
        elif kind == "noise":
            data = (self._rng.standard_normal(n) * 3000).clip(-32000, 32000).astype(np.int16)
        else:
            t = (np.arange(n) + offset) / rate
            data = (np.sin(2 * math.pi * self.options.tone_hz * t) * 8000).astype(np.int16)
        return data.tobytes()

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


# keep WorkerCrash importable from here for tests that inject real thread deaths
__all__ = ["TestStage", "TestStageOptions", "WorkerCrash"]
