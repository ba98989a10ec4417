"""The deterministic test roles on the batching runtime (``backend: test-batch``).

:class:`BatchTestStage` plays ``asr``, ``llm`` and ``tts`` as :class:`TestStage` does
(engine/stages/testing.py, whose options it takes) but on the batching runtime
(engine/stages/batching.py): one worker thread, one ``step`` over many requests, ``step_s``
of simulated compute per step whatever the batch size. For tests and benchmarks only.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

import msgspec
import numpy as np

from duplex_contract.audio import duration_ms
from duplex_contract.batch import AudioOut, TextOut, TranscriptOut
from duplex_contract.errors import ConfigError, StageError
from engine.messages import AsrRequest, LlmRequest, StageDone, StageRequest, TtsRequest
from engine.stages.batching import BatchingRuntime, BatchSlot
from engine.stages.stage_front import BatchingFront
from engine.stages.testing import KEEP_IDS, ROLES, TestStageOptions, resolve_role
from engine.stages.workers import WorkerCrash


class BatchTestStage(BatchingFront):
    """The test roles on the batching runtime: one step advances every request in it.

    asr: one step per request (the transcript); llm: one word per step; tts: one audio
    chunk per step. ``step_s`` is slept once per step whatever the batch size (a batched
    forward pass). ``batches`` records the request ids of each step (tests check who ran
    together; the last KEEP_IDS steps). fail_on / crash_on / hang_on work as in :class:`TestStage`
    (crash_on kills the worker thread: :class:`WorkerCrash`). The stage interface is its
    :class:`BatchingRuntime`'s.
    """

    __test__ = False
    Options: ClassVar[type[msgspec.Struct]] = TestStageOptions
    device_kinds: ClassVar[frozenset[str]] = frozenset({"cpu"})
    keeps_auto: ClassVar[bool] = False

    def __init__(
        self, options: TestStageOptions, name: str, *, device: str = "cpu", stage: str | None = None
    ) -> None:
        self.opts = options
        self.name = name
        self.device = device
        self.role = resolve_role(options, stage or name)
        if self.role not in ("asr", "llm", "tts"):
            raise ConfigError(
                f"engine.stages.{stage or name}.options.role: test-batch plays asr, llm or tts"
            )
        self.consumes, self.emits = ROLES[self.role]
        self.batches: list[tuple[str, ...]] = []
        self.runtime = BatchingRuntime(name, self, options.max_batch)

    def serving(self) -> BatchingRuntime:
        return self.runtime

    @classmethod
    def cuda_device_count(cls) -> int:
        return 0

    # -- the stage interface: its runtime's --------------------------------------------
    @property
    def capacity(self) -> int:
        return self.runtime.capacity

    # -- the model (worker thread) -----------------------------------------------------
    def load(self) -> None:
        time.sleep(self.opts.load_delay_s)

    def unload(self) -> None:
        pass

    def prepare(self, request: StageRequest) -> Any:
        o = self.opts
        if isinstance(request, AsrRequest):
            ms = duration_ms(len(request.audio), request.sample_rate)
            text = o.transcript or f"user audio of {ms:.0f} milliseconds"
            return [text]
        if isinstance(request, LlmRequest):
            words = self._reply(request).split(" ")[: request.max_tokens]
            return [w if i == 0 else " " + w for i, w in enumerate(words)]
        if isinstance(request, TtsRequest):
            n_words = max(1, len(request.text.split()))
            total = int(request.sample_rate * n_words * o.ms_per_word / request.speed / 1000)
            chunk = max(1, int(request.sample_rate * o.chunk_ms / 1000))
            return [min(chunk, total - i) for i in range(0, total, chunk)]
        raise StageError(f"{self.name}: unexpected {type(request).__name__}")

    @staticmethod
    def _text(request: StageRequest) -> str:
        if isinstance(request, TtsRequest):
            return request.text
        if isinstance(request, LlmRequest):
            return next((m.content for m in reversed(request.messages) if m.role == "user"), "")
        return ""

    def step(self, batch: Sequence[BatchSlot]) -> None:
        o = self.opts
        if o.step_s:
            time.sleep(o.step_s)
        self.batches.append(tuple(s.request.request_id for s in batch))
        if len(self.batches) > KEEP_IDS:
            del self.batches[: KEEP_IDS // 2]
        for slot in batch:
            req, pending = slot.request, slot.state
            text = self._text(req) or (pending[0] if isinstance(req, AsrRequest) else "")
            if o.crash_on and o.crash_on in text:
                raise WorkerCrash(f"{self.name}: injected crash")
            if o.fail_on and o.fail_on in text:
                slot.fail(StageError(f"{self.name}: injected failure"))
                continue
            if o.hang_on and o.hang_on in text:
                continue  # takes part in every step, never finishes (until aborted)
            if not pending:
                slot.emit(self._done(req))
                slot.finish()
                continue
            item = pending[0]
            if isinstance(req, AsrRequest):
                slot.emit(TranscriptOut(request_id=req.request_id, text=item, final=True))
            elif isinstance(req, LlmRequest):
                slot.emit(TextOut(request_id=req.request_id, text=item))
            else:
                assert isinstance(req, TtsRequest)
                t = np.arange(item) / req.sample_rate
                pcm = (np.sin(2 * math.pi * o.tone_hz * t) * 8000).astype(np.int16).tobytes()
                slot.emit(
                    AudioOut(
                        request_id=req.request_id,
                        pcm=pcm,
                        sample_rate=req.sample_rate,
                        t_ns=time.monotonic_ns(),
                    )
                )
            slot.state = pending[1:]  # state changes only once nothing can raise
            if not slot.state:
                slot.emit(self._done(req))
                slot.finish()

    def _done(self, req: StageRequest) -> StageDone:
        if isinstance(req, LlmRequest):
            words = len(self._reply(req).split(" "))
            n = min(words, req.max_tokens)
            reason: Literal["stop", "length"] = "length" if words > req.max_tokens else "stop"
            return StageDone(request_id=req.request_id, finish_reason=reason, tokens=n)
        return StageDone(request_id=req.request_id)

    def _reply(self, req: LlmRequest) -> str:
        last = next((m.content for m in reversed(req.messages) if m.role == "user"), "")
        return last if self.opts.echo else self.opts.reply


__all__ = ["BatchTestStage"]
