"""LLM stage on vLLM's ``AsyncLLM`` (v1 engine): the GPU path for the AR model.

One :class:`VllmLlm` holds one :class:`VllmEngine` (engine/stages/vllm_engine.py): an
``AsyncLLM`` on a private loop thread, whose EngineCore process schedules every running
request in one continuous batch, so concurrent ``submit`` calls from different sessions
share each forward pass; the engine also restarts a dead EngineCore and reports vLLM's
figures. The talker (engine/stages/talker_vllm.py) holds the same engine.

Per request: the prompt is the request's messages rendered with the model's chat template
(``add_generation_prompt``), trimmed from the oldest turn if it outgrows ``max_model_len``;
sampling comes from the request (temperature, max_tokens) and the options (top_p, top_k,
seed). Outputs stream as one :class:`TextOut` per detokenized delta (``RequestOutputKind
.DELTA``), then ``StageDone(finish_reason, tokens)``. ``abort`` ends the stream at once
(``StageDone("aborted")``; no later chunk is forwarded) and aborts the request in vLLM.

Tools: under ``LlmRequest.tool_required`` the sampling params carry vLLM structured outputs
(``StructuredOutputsParams(json=...)``, guided JSON) with the schema of one call of the
tools (:func:`duplex_contract.tools.call_schema`); under ``auto`` decoding is free and the
orchestrator validates whatever call the model writes.

Start-up errors are :class:`ConfigError` naming the option, e.g.
``engine.stages.llm.options.model: /x is not a Hugging Face model directory``.
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, ClassVar

from duplex_contract.batch import ChatMessage, TextOut
from duplex_contract.errors import ConfigError, StageError
from duplex_contract.tools import call_schema
from engine.gpu_memory import GpuMemory
from engine.messages import LlmRequest, StageRequest
from engine.stages import vllm_options as vo
from engine.stages.edges import Edge
from engine.stages.vllm_chat import fit_prompt
from engine.stages.vllm_engine import VllmEngine, torch_cuda_devices
from engine.stages.vllm_env import VllmPlacement
from engine.stages.vllm_front import VllmFront
from engine.stages.vllm_loop import RequestStream
from engine.stages.vllm_options import VllmOptions


class VllmLlm(VllmFront):
    """The StageBackend protocol on one ``AsyncLLM`` (continuous batching, streaming).

    The stage interface is its :class:`VllmEngine`'s; this class is the text model
    (:class:`engine.stages.vllm_engine.VllmModel`: which model, its checks and warm-up)
    and turns each request into a prompt and sampling params."""

    Options: ClassVar[type[VllmOptions]] = VllmOptions
    consumes: Edge = Edge.TEXT
    emits: Edge = Edge.TEXT
    device_kinds: ClassVar[frozenset[str]] = frozenset({"cpu", "cuda"})
    # "auto" stays "auto": vLLM places itself (all visible GPUs with tensor parallelism)
    keeps_auto: ClassVar[bool] = True

    def __init__(
        self, options: VllmOptions, name: str, *, device: str = "auto", stage: str | None = None
    ) -> None:
        self.options = options
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

    @classmethod
    def cuda_device_count(cls) -> int:
        return torch_cuda_devices()

    def start_devices(self) -> frozenset[str]:
        """The GPUs this replica takes while it starts (engine/startup.py orders by them)."""
        return self.placement.start_devices()

    @property
    def capacity(self) -> int:
        """Request slots (engine/orchestration/scheduling.py): sequences per batch."""
        return self.options.max_num_seqs

    def gpu_memory(self) -> GpuMemory:
        """What it takes on its GPU (engine/gpu_memory.py): vLLM's share of the device, or
        the KV cache it was given (then the weights beside it are not counted)."""
        o = self.options
        if o.kv_cache_memory_gib is not None:
            return GpuMemory(gib=o.kv_cache_memory_gib, process="own")
        return GpuMemory(share=o.gpu_memory_utilization, process="own")

    # ------------------------------------------------------------------ the model
    def resolve_model(self) -> str:
        return vo.resolve_model(self.options.model, self.field, self.name)

    def engine_args(self) -> dict[str, Any]:
        return {}

    async def warm_up(self, model: str) -> None:
        # (probes of vLLM's own objects, which differ between its versions; not a backend's)
        if getattr(self.engine.tokenizer, "chat_template", None) is None:
            raise ConfigError(f"{self.field}.model: {model} has no chat template")
        if self.options.warmup:
            warm = LlmRequest(
                request_id=f"{self.name}/warmup",
                messages=(ChatMessage(role="user", content="Hi"),),
                max_tokens=1,
            )
            prompt, params, _ = self._inputs(warm)
            async for _ in self.engine.llm.generate(prompt, params, warm.request_id):
                pass

    # ------------------------------------------------------------------ requests
    def _inputs(self, request: LlmRequest) -> tuple[Any, Any, int]:
        """(prompt, sampling params, prompt tokens) for ``generate`` (vLLM loop)."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        ids, max_tokens = fit_prompt(
            self.engine.tokenizer,
            request.messages,
            request.max_tokens,
            self.engine.max_model_len,
            self.name,
        )
        greedy = request.temperature <= 0.0
        extra: dict[str, Any] = {}
        if request.tools and request.tool_required:
            # structured outputs (guided JSON): the output is one call of the tools
            from vllm.sampling_params import StructuredOutputsParams

            extra["structured_outputs"] = StructuredOutputsParams(json=call_schema(request.tools))
        params = SamplingParams(
            temperature=0.0 if greedy else request.temperature,
            top_p=1.0 if greedy else self.options.top_p,
            top_k=0 if greedy else self.options.top_k,
            max_tokens=max_tokens,
            seed=self.options.seed,
            output_kind=RequestOutputKind.DELTA,
            **extra,
        )
        prompt = self.engine.engine_input(TokensPrompt(prompt_token_ids=ids))
        return prompt, params, len(ids)

    def produce(self, request: StageRequest, stream: RequestStream) -> Coroutine[Any, Any, None]:
        """The coroutine (run on the vLLM loop) that feeds ``stream`` for ``request``."""
        if not isinstance(request, LlmRequest):
            raise StageError(f"{self.name}: expected an LlmRequest, got {type(request).__name__}")
        rid = request.request_id

        def each(completion: Any) -> None:
            stream.tokens += len(completion.token_ids)
            if completion.text:
                stream.deliver(TextOut(request_id=rid, text=completion.text))

        return self.engine.generate_into(stream, request, lambda: self._inputs(request), each)


__all__ = ["VllmLlm", "VllmOptions"]
