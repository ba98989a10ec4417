"""Talker stage on vLLM's ``AsyncLLM``: a codec language model that speaks codec frames.

Consumes ``text`` (one request per segment the segmenter releases, so the first clause is
spoken while the responder still writes the next), emits ``codec``: :class:`TokensOut` with
the codes of the tokens sampled in each engine step, converted by the layout
(engine/codec_layout.py; first layout: Orpheus, 7 SNAC codes per frame over 3 codebooks).
Everything model-specific is in the layout; another codec LM is another layout.

It runs exactly like the text LM stage (engine/stages/llm_vllm.py, whose engine plumbing it
inherits): one ``AsyncLLM`` per replica on a private loop thread, every session's clause in
one continuous batch, request ids that embed the fence, and ``abort`` that ends the stream at
once and aborts the request in vLLM (it leaves the batch before the next engine step).

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

import asyncio
import logging
import zlib
from collections.abc import Coroutine
from typing import Annotated, Any, ClassVar

import msgspec

from duplex_contract.errors import ConfigError, StageError
from engine.codec_layout import CodecLayout, FrameError, get_layout
from engine.messages import StageDone, StageRequest, TokensOut, TtsRequest
from engine.orchestration.edges import Edge
from engine.stages.llm_vllm import VllmLlm, VllmOptions
from engine.stages.vllm_loop import _END, FinishReason, _Job

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


class VllmTalker(VllmLlm):
    """Text segments -> codec codes, on one ``AsyncLLM``."""

    Options: ClassVar[type[TalkerOptions]] = TalkerOptions
    consumes: Edge = Edge.TEXT
    emits: Edge = Edge.CODEC

    def __init__(
        self, options: TalkerOptions, name: str, *, device: str = "auto", stage: str | None = None
    ) -> None:
        super().__init__(options, name, device=device, stage=stage)
        self.topts = options
        try:
            self.layout: CodecLayout = get_layout(options.layout)
        except FrameError as exc:
            raise ConfigError(f"{self.field}.layout: {exc}") from None

    def voices(self) -> tuple[str, ...]:
        """The default voice, the layout's voices and those with sampling presets."""
        default = self.topts.voice or self.layout.default_voice
        return tuple(dict.fromkeys((default, *self.layout.voices, *self.topts.voices)))

    # ------------------------------------------------------------------ start-up
    def _resolve_model(self) -> str:
        if self.options.model is not None:
            return super()._resolve_model()
        try:
            from engine.talker_prepare import prepare

            path = prepare()
        except ConfigError as exc:
            raise ConfigError(f"{self.field}.model: the tiny talker: {exc}") from None
        self.model_path = str(path)
        return self.model_path

    async def _boot(self) -> None:
        opts = self.topts
        # the text LM's start-up, with the frame-constraining logits processor
        model = await self._start_engine({"logits_processors": [LOGITS_PROCESSOR]})
        vocab = int(self._engine.model_config.get_vocab_size())
        if vocab < self.layout.audio_range.stop:
            raise ConfigError(
                f"{self.field}.model: {model} has {vocab} token ids, but layout "
                f"{self.layout.name!r} needs audio tokens up to {self.layout.audio_range.stop - 1}"
            )
        if opts.warmup:
            warm = TtsRequest(request_id=f"{self.name}/warmup", text="Hi.")
            prompt, params, rid, _ = self._talker_inputs(warm, frames=1)
            async for _ in self._engine.generate(prompt, params, rid):
                pass

    # ------------------------------------------------------------------ requests
    def _encode(self, text: str) -> list[int]:
        ids: list[int] = self._tokenizer.encode(text, add_special_tokens=True)
        return ids

    def _talker_inputs(
        self, request: TtsRequest, frames: int | None = None
    ) -> tuple[Any, Any, str, int]:
        """(prompt, sampling params, request id, prompt tokens) for ``generate`` (vLLM loop)."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        o, lay = self.topts, self.layout
        voice = request.voice or o.voice
        ids = lay.prompt_ids(self._encode, request.text, voice)
        f = lay.frame_size
        room = (self.max_model_len - len(ids)) // f
        if room < 1:
            raise StageError(
                f"{self.name}: a segment of {len(ids)} prompt tokens leaves no room for a frame "
                f"in max_model_len={self.max_model_len}"
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
        prompt = TokensPrompt(prompt_token_ids=ids)
        renderer = getattr(self._engine, "renderer", None)  # (vLLM's object: versions differ)
        if renderer is not None and hasattr(renderer, "render_cmpl"):
            (engine_input,) = renderer.render_cmpl([prompt], renderer.default_cmpl_tok_params)
            return engine_input, params, request.request_id, len(ids)
        return prompt, params, request.request_id, len(ids)

    async def _speak(self, request: TtsRequest, job: _Job) -> None:
        """Run one segment on the engine; push its codes to ``job`` (vLLM loop)."""
        rid = request.request_id
        lay = self.layout
        try:
            prompt, params, _, n_prompt = self._talker_inputs(request)
            realtime_first = self.options.scheduling_policy == "priority"
            reason: str | None = None
            ended = False
            async for out in self._engine.generate(
                prompt, params, rid, priority=int(request.priority) if realtime_first else 0
            ):
                for completion in out.outputs[:1]:
                    codes: list[int] = []
                    for token in completion.token_ids:
                        if ended or token in lay.end_ids:
                            ended = True
                            continue
                        codes.append(lay.token_to_code(int(token), job.tokens % lay.frame_size))
                        job.tokens += 1
                    if codes:
                        job.deliver(TokensOut(request_id=rid, ids=tuple(codes)))
                    if out.finished:
                        reason = completion.finish_reason
            finish: FinishReason
            if reason == "abort":
                finish = "aborted"
            elif reason in ("stop", "length"):
                finish = "stop" if reason == "stop" else "length"
            else:
                raise StageError(f"{self.name}: request ended with {reason!r}")
            job.deliver(
                StageDone(
                    request_id=rid, finish_reason=finish, tokens=job.tokens, prompt_tokens=n_prompt
                )
            )
        except asyncio.CancelledError:
            raise
        except FrameError as exc:
            log.error("%s: request %s: %s", self.name, rid, exc)
            job.deliver(StageError(f"{self.name}: {exc}", code="stage_failed"))
        except StageError as exc:
            job.deliver(exc)
        except Exception as exc:
            log.exception("%s: request %s failed", self.name, rid)
            job.deliver(self._request_error(exc))
        finally:
            job.deliver(_END)

    def _producer(self, request: StageRequest, job: _Job) -> Coroutine[Any, Any, None]:
        if not isinstance(request, TtsRequest):
            raise StageError(f"{self.name}: expected a TtsRequest, got {type(request).__name__}")
        return self._speak(request, job)

    async def engine_request_ids(self) -> list[str]:
        """The (external) ids of the requests vLLM itself still holds: what an abort must
        have removed (tests check barge-ins here, not in our own bookkeeping)."""
        if self._engine is None:
            return []
        return await self._call(self._held_ids())

    async def _held_ids(self) -> list[str]:
        # (probes of vLLM's internals, which differ between its versions; not a backend's)
        states = getattr(getattr(self._engine, "output_processor", None), "request_states", {})
        return sorted(str(getattr(s, "external_req_id", None) or k) for k, s in states.items())


__all__ = ["TalkerOptions", "VllmTalker", "VoiceSampling"]
