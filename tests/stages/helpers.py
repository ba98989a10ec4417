"""Shared helpers of the stage tests: WER, running a request through a stage backend."""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass, field

import numpy as np

from duplex_contract.batch import AudioOut, TextOut
from engine.messages import StageDone, StageOutput, StageRequest
from engine.stages.base import StageBackend

BECKETT_REF = "Ever tried. Ever failed. No matter. Try again. Fail again. Fail better."


def words(text: str) -> list[str]:
    """Lower-case words without punctuation (apostrophes kept inside words)."""
    return re.sub(r"[^a-z0-9' ]+", " ", text.lower().replace("-", " ")).split()


def wer(reference: str, hypothesis: str) -> float:
    """Word error rate: word-level Levenshtein distance / reference length."""
    ref, hyp = words(reference), words(hypothesis)
    if not ref:
        return 0.0 if not hyp else 1.0
    prev = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        cur = [i] + [0] * len(hyp)
        for j, h in enumerate(hyp, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (r != h))
        prev = cur
    return prev[-1] / len(ref)


@dataclass
class Run:
    outputs: list[StageOutput] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # perf_counter of each output
    started: float = 0.0

    @property
    def done(self) -> StageDone:
        last = self.outputs[-1]
        assert isinstance(last, StageDone), f"last output is {last!r}"
        return last

    @property
    def text(self) -> str:
        return "".join(o.text for o in self.outputs if isinstance(o, TextOut))

    @property
    def audio(self) -> list[AudioOut]:
        return [o for o in self.outputs if isinstance(o, AudioOut)]

    @property
    def pcm(self) -> bytes:
        return b"".join(o.pcm for o in self.audio)


async def collect(backend: StageBackend, request: StageRequest) -> Run:
    run = Run(started=time.perf_counter())
    async for out in backend.submit(request):
        run.outputs.append(out)
        run.times.append(time.perf_counter())
    return run


def run_request(backend: StageBackend, request: StageRequest) -> Run:
    """Submit one request through the backend's worker thread and collect every output."""
    return asyncio.run(collect(backend, request))


def rms_dbfs(pcm: bytes) -> float:
    x = np.frombuffer(pcm, dtype="<i2").astype(np.float64) / 32768.0
    return float(20 * np.log10(max(float(np.sqrt(np.mean(x * x))), 1e-9)))
