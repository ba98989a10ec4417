"""Talker stage on vLLM's ``AsyncLLM``: a codec language model that speaks codec frames.

Consumes ``text`` (one request per segment the segmenter releases, so the first clause is
spoken while the responder still writes the next), emits ``codec``: :class:`TokensOut` with
the codes of the tokens sampled in each engine step, converted by the layout
(engine/codec_layout.py; first layout: Orpheus, 7 SNAC codes per frame over 3 codebooks).
Everything model-specific is in the layout; another codec LM is another layout.

It runs exactly like the text LM stage (engine/stages/llm_vllm.py): it holds the same
:class:`VllmEngine` (engine/stages/vllm_engine.py), one ``AsyncLLM`` per replica on a private
loop thread, every session's clause in one continuous batch, request ids that embed the
fence, and ``abort`` that ends the stream at once and aborts the request in vLLM (it leaves
the batch before the next engine step).

Per request: the prompt is the layout's (``<start_of_human>`` "voice: text" ... for
Orpheus); the voice is the session's (``TtsRequest.voice``) or the ``voice`` option; the
sampling (temperature, top_p, top_k, repetition_penalty) is the options', overridden per
voice by ``voices``. Generation is held to the codec vocabulary by a logits processor
(engine/stages/talker_logits.py): at each position of a frame only that codebook's tokens,
and the end token only between frames, so any weights give whole, in-range frames. A token
that is not (impossible unless the processor is bypassed) fails the request with a
:class:`FrameError` message; nothing of it is decoded. ``max_frames`` caps one segment.

Weights: ``model`` is an HF directory of the codec LM (a deployment fetches e.g. an Orpheus
3B fine-tune itself); ``null`` is the tiny random-weight talker made by
``engine.talker_prepare`` (CI: its audio is noise).
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Coroutine
from typing import Annotated, Any, ClassVar

import msgspec

from duplex_contract.errors import ConfigError, StageError
from engine.codec_layout import CodecLayout, FrameError, get_layout
from engine.gpu_memory import GpuMemory
from engine.messages import StageRequest, TokensOut, TtsRequest
from engine.stage_figures import Pace
from engine.stages import vllm_options as vo
from engine.stages.edges import Edge
from engine.stages.vllm_engine import VllmEngine, torch_cuda_devices
from engine.stages.vllm_env import VllmPlacement
from engine.stages.vllm_front import VllmFront
from engine.stages.vllm_loop import RequestStream
from engine.stages.vllm_options import VllmOptions

log = logging.getLogger(__name__)

LOGITS_PROCESSOR = "engine.stages.talker_logits:CodecFrameLogits"


class VoiceSampling(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Per-voice sampling overrides (None: the stage's option)."""

    temperature: Annotated[float, msgspec.Meta(ge=0)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    top_k: Annotated[int, msgspec.Meta(ge=0)] | None = None
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0)] | None = None


class TalkerOptions(VllmOptions, frozen=True, forbid_unknown_fields=True):
    # HF directory of the codec LM; None: the tiny random-weight talker (engine.talker_prepare)
    layout: str = "orpheus"  # engine/codec_layout.py
    voice: str | None = None  # default voice (None: the layout's, "tara" for Orpheus)
    voices: dict[str, VoiceSampling] = {}
    temperature: Annotated[float, msgspec.Meta(ge=0)] = 0.6  # Orpheus's recommended sampling
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.8
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0)] = 1.1
    max_frames: Annotated[int, msgspec.Meta(ge=1)] = 512  # per segment (512 frames = 43.7 s)
    max_model_len: Annotated[int, msgspec.Meta(ge=64)] | None = 4096


class VllmTalker(VllmFront):
    """Text segments -> codec codes, on one ``AsyncLLM``.

    The stage interface is its :class:`VllmEngine`'s (as the text LM's); this class is the
    talker model (:class:`engine.stages.vllm_engine.VllmModel`: which model, the frame
    logits processor, its checks and warm-up) and turns each segment into a prompt and
    sampling params, and sampled tokens into codes."""

    Options: ClassVar[type[TalkerOptions]] = TalkerOptions
    consumes: Edge = Edge.TEXT
    emits: Edge = Edge.CODEC
    device_kinds: ClassVar[frozenset[str]] = frozenset({"cpu", "cuda"})
    # "auto" stays "auto": vLLM places itself (all visible GPUs with tensor parallelism)
    keeps_auto: ClassVar[bool] = True

    def __init__(
        self, options: TalkerOptions, name: str, *, device: str = "auto", stage: str | None = None
    ) -> None:
        self.topts = options
        self.name = name
        self.device = device  # this replica's placement: auto, cpu or cuda:N
        self.stage = stage or name
        self.field = f"engine.stages.{self.stage}.options"  # named in start-up errors
        self.placement = VllmPlacement(
            options,
            name=name,
            stage=self.stage,
            device=device,
            cuda_count=self.cuda_device_count() if device != "cpu" else 0,
        )
        self.engine = VllmEngine(
            options, name, stage=self.stage, placement=self.placement, model=self
        )
        try:
            self.layout: CodecLayout = get_layout(options.layout)
        except FrameError as exc:
            raise ConfigError(f"{self.field}.layout: {exc}") from None

    @classmethod
    def cuda_device_count(cls) -> int:
        return torch_cuda_devices()

    def start_devices(self) -> frozenset[str]:
        """The GPUs this replica takes while it starts (engine/startup.py orders by them)."""
        return self.placement.start_devices()

    @property
    def capacity(self) -> int:
        """Request slots (engine/orchestration/scheduling.py): sequences per batch."""
        return self.topts.max_num_seqs

    def gpu_memory(self) -> GpuMemory:
        """What it takes on its GPU (engine/gpu_memory.py): vLLM's share of the device, or
        the KV cache it was given (then the weights beside it are not counted)."""
        o = self.topts
        if o.kv_cache_memory_gib is not None:
            return GpuMemory(gib=o.kv_cache_memory_gib, process="own")
        return GpuMemory(share=o.gpu_memory_utilization, process="own")

    def pace(self) -> Pace | None:
        """Codec tokens per second each running segment gets (vLLM's generation rate over
        the last seconds, shared by the running requests) against the rate its audio plays
        at (engine/stage_figures.py; the scheduling policy's real-time budget)."""
        figs = self.engine.figures.snapshot()
        if figs.running <= 0:
            return None
        need = 1000.0 / self.layout.frame_ms * self.layout.frame_size
        return Pace(streams=figs.running, rate=figs.tokens_per_s / figs.running, need=need)

    def voices(self) -> tuple[str, ...]:
        """The default voice, the layout's voices and those with sampling presets."""
        default = self.topts.voice or self.layout.default_voice
        return tuple(dict.fromkeys((default, *self.layout.voices, *self.topts.voices)))

    # ------------------------------------------------------------------ the model
    def resolve_model(self) -> str:
        if self.topts.model is not None:
            return vo.resolve_model(self.topts.model, self.field, self.name)
        try:
            from engine.talker_prepare import prepare

            path = prepare()
        except ConfigError as exc:
            raise ConfigError(f"{self.field}.model: the tiny talker: {exc}") from None
        return str(path)

    def engine_args(self) -> dict[str, Any]:
        return {"logits_processors": [LOGITS_PROCESSOR]}  # whole, in-range frames

    async def warm_up(self, model: str) -> None:
        vocab = int(self.engine.llm.model_config.get_vocab_size())
        if vocab < self.layout.audio_range.stop:
            raise ConfigError(
                f"{self.field}.model: {model} has {vocab} token ids, but layout "
                f"{self.layout.name!r} needs audio tokens up to {self.layout.audio_range.stop - 1}"
            )
        if self.topts.warmup:
            warm = TtsRequest(request_id=f"{self.name}/warmup", text="Hi.")
            prompt, params, _ = self._inputs(warm, frames=1)
            async for _ in self.engine.llm.generate(prompt, params, warm.request_id):
                pass

    # ------------------------------------------------------------------ requests
    def _encode(self, text: str) -> list[int]:
        ids: list[int] = self.engine.tokenizer.encode(text, add_special_tokens=True)
        return ids

    def _inputs(self, request: TtsRequest, frames: int | None = None) -> tuple[Any, Any, int]:
        """(prompt, sampling params, prompt tokens) for ``generate`` (vLLM loop)."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        o, lay = self.topts, self.layout
        voice = request.voice or o.voice
        ids = lay.prompt_ids(self._encode, request.text, voice)
        f = lay.frame_size
        room = (self.engine.max_model_len - len(ids)) // f
        if room < 1:
            raise StageError(
                f"{self.name}: a segment of {len(ids)} prompt tokens leaves no room for a frame "
                f"in max_model_len={self.engine.max_model_len}"
            )
        n_frames = min(frames or o.max_frames, room)
        preset = o.voices.get(voice or lay.default_voice, VoiceSampling())
        temperature = preset.temperature if preset.temperature is not None else o.temperature
        greedy = temperature <= 0.0
        seed = None if o.seed is None else (o.seed ^ zlib.crc32(request.request_id.encode()))
        params = SamplingParams(
            temperature=0.0 if greedy else temperature,
            top_p=1.0 if greedy else (preset.top_p or o.top_p),
            top_k=0 if greedy else (preset.top_k if preset.top_k is not None else o.top_k),
            repetition_penalty=preset.repetition_penalty or o.repetition_penalty,
            max_tokens=n_frames * f,
            stop_token_ids=list(lay.end_ids),
            detokenize=False,
            skip_special_tokens=False,
            seed=seed,
            output_kind=RequestOutputKind.DELTA,
            extra_args={"codec_frames": [lay.audio_base, lay.codebook_size, f, list(lay.end_ids)]},
        )
        prompt = self.engine.engine_input(TokensPrompt(prompt_token_ids=ids))
        return prompt, params, len(ids)

    def produce(self, request: StageRequest, stream: RequestStream) -> Coroutine[Any, Any, None]:
        """The coroutine (run on the vLLM loop) that speaks one segment into ``stream``."""
        if not isinstance(request, TtsRequest):
            raise StageError(f"{self.name}: expected a TtsRequest, got {type(request).__name__}")
        rid = request.request_id
        lay = self.layout
        ended = False  # the end token came: later tokens of the step are not speech

        def each(completion: Any) -> None:
            nonlocal ended
            codes: list[int] = []
            for token in completion.token_ids:
                if ended or token in lay.end_ids:
                    ended = True
                    continue
                try:
                    codes.append(lay.token_to_code(int(token), stream.tokens % lay.frame_size))
                except FrameError as exc:
                    log.error("%s: request %s: %s", self.name, rid, exc)
                    raise StageError(f"{self.name}: {exc}", code="stage_failed") from None
                stream.tokens += 1
            if codes:
                stream.deliver(TokensOut(request_id=rid, ids=tuple(codes)))

        return self.engine.generate_into(stream, request, lambda: self._inputs(request), each)


__all__ = ["TalkerOptions", "VllmTalker", "VoiceSampling"]
