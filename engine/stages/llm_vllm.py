"""LLM stage on vLLM's ``AsyncLLM`` (v1 engine): the GPU path for the AR model.

One :class:`VllmLlm` owns one ``AsyncLLM``. vLLM runs the model in its own EngineCore
process (always, for ``AsyncLLM``; spawned on CPU, so scripts need a ``__main__`` guard)
and schedules every running request in one continuous batch, so concurrent ``submit``
calls from different sessions share each forward pass.

Threading: the ``AsyncLLM`` front end (chat template, tokenizer, incremental detokenizer,
output processing) lives on a private event loop in a thread of its own, never on the
orchestrator's loop. ``submit`` hands a request to that loop and reads its outputs back
through an ``asyncio.Queue`` fed with ``call_soon_threadsafe``; start-up (import, engine
spawn, warm-up) and shutdown block only that thread.

Per request: the prompt is the request's messages rendered with the model's chat template
(``add_generation_prompt``), trimmed from the oldest turn if it outgrows ``max_model_len``;
sampling comes from the request (temperature, max_tokens) and the options (top_p, top_k,
seed). Outputs stream as one :class:`TextOut` per detokenized delta (``RequestOutputKind
.DELTA``), then ``StageDone(finish_reason, tokens)``. The vLLM request id is the stage
request id, which embeds the fence (``sess_x/e3/t5/r1/llm``). ``abort`` ends the stream at
once (``StageDone("aborted")``; no later chunk is forwarded) and aborts the request in vLLM.

Tools: under ``LlmRequest.tool_required`` the sampling params carry vLLM structured outputs
(``StructuredOutputsParams(json=...)``, guided JSON) with the schema of one call of the
tools (:func:`duplex_contract.tools.call_schema`); under ``auto`` decoding is free and the
orchestrator validates whatever call the model writes.

Start-up errors are :class:`ConfigError` naming the option, e.g.
``engine.stages.llm.options.model: /x is not a Hugging Face model directory``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from typing import Any, ClassVar, TypeVar

from duplex_contract.batch import ChatMessage, TextOut
from duplex_contract.errors import ConfigError, StageError
from duplex_contract.tools import call_schema
from engine.messages import LlmRequest, StageDone, StageOutput, StageRequest
from engine.orchestration.edges import Edge
from engine.placement import child_visible_devices, replica_gpus
from engine.stage_figures import StageEngineFigures
from engine.stages import vllm_options as vo
from engine.stages.supervisor import Supervisor
from engine.stages.vllm_chat import fit_prompt
from engine.stages.vllm_env import engine_env, option_error, release_zmq
from engine.stages.vllm_loop import _END, FinishReason, _Job, run_loop
from engine.stages.vllm_options import VllmOptions
from engine.stages.vllm_stats import (
    EngineFigures,
    engine_core_pid,
    engine_exit,
    stat_logger_factory,
)

log = logging.getLogger(__name__)

T = TypeVar("T")


class VllmLlm:
    """The StageBackend protocol on one ``AsyncLLM`` (continuous batching, streaming)."""

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
        cuda_count = self.cuda_device_count() if device != "cpu" else 0
        vo.check_parallel(
            options,
            field=self.field,
            device=device,
            cuda_count=cuda_count,
            has_ray=options.distributed_executor_backend != "ray" or vo.ray_installed(),
        )
        # GPUs this replica is pinned to (None: vLLM places itself); checked before any start
        self.gpus = replica_gpus(
            device=device,
            device_ids=options.device_ids,
            tensor_parallel_size=vo.workers(options),  # one GPU per worker (tp x pp x dp)
            cuda_count=cuda_count,
            where=f"engine.stages.{self.stage}",
            replica=name,
        )
        if self.gpus is not None:
            self._child_visible()
        self.supervisor = Supervisor(
            name,
            probe=self._engine_dead,
            fail_requests=self._fail_all,
            restart=self._restart_engine,
            max_restarts=options.max_restarts,
            interval_s=options.health_interval_s,
            backoff_s=options.restart_backoff_s,
        )
        self.figures = EngineFigures()  # vLLM's scheduler stats, for /metrics
        self._watch: concurrent.futures.Future[None] | None = None
        self.model_path: str | None = None
        self.max_model_len = 0
        self.start_s = 0.0  # engine start-up time (spawn + load + warm-up), measured
        self._jobs: dict[str, _Job] = {}
        self._vloop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._engine: Any = None
        self._tokenizer: Any = None
        self._closing = False

    @classmethod
    def cuda_device_count(cls) -> int:
        try:
            import torch
        except ImportError:
            return 0
        return int(torch.cuda.device_count())

    def start_devices(self) -> frozenset[str]:
        """The GPUs this replica takes while it starts (engine/startup.py orders by them)."""
        if self.gpus is not None:
            return frozenset(f"cuda:{i}" for i in self.gpus)
        if self.device == "auto":  # vLLM places itself: on every GPU there is
            return frozenset(f"cuda:{i}" for i in range(self.cuda_device_count()))
        return frozenset()

    def _child_visible(self) -> str:
        assert self.gpus is not None
        return child_visible_devices(
            self.gpus,
            os.environ.get("CUDA_VISIBLE_DEVICES"),
            where=f"engine.stages.{self.stage}.devices",
            replica=self.name,
        )

    @property
    def restarts(self) -> int:
        return self.supervisor.restarts

    @property
    def capacity(self) -> int:
        """Request slots (engine/orchestration/scheduling.py): sequences per batch."""
        return self.options.max_num_seqs

    @property
    def on_wait(self) -> Callable[[float], None] | None:
        """Queue time of each finished request in vLLM's scheduler (engine/stage_figures.py)."""
        return self.figures.on_wait

    @on_wait.setter
    def on_wait(self, hook: Callable[[float], None] | None) -> None:
        self.figures.on_wait = hook

    def engine_figures(self) -> StageEngineFigures:
        return self.figures.snapshot()

    def health(self) -> str | None:
        """Why this replica is down (its EngineCore died, or restarting), or None."""
        return self.supervisor.health()

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self._closing = False
        ready: concurrent.futures.Future[asyncio.AbstractEventLoop] = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=run_loop, args=(ready, self.name), name=f"vllm-{self.name}", daemon=True
        )
        self._thread.start()
        self._vloop = await asyncio.wrap_future(ready)
        started = time.perf_counter()
        try:
            await asyncio.wait_for(self._call(self._boot()), self.options.start_timeout_s)
        except TimeoutError:
            await self.close()
            raise ConfigError(
                f"{self.field}.start_timeout_s: vLLM did not start within "
                f"{self.options.start_timeout_s:.0f} s"
            ) from None
        except BaseException:
            await self.close()
            raise
        self.start_s = time.perf_counter() - started
        assert self._vloop is not None
        self._watch = asyncio.run_coroutine_threadsafe(self.supervisor.run(), self._vloop)
        log.info(
            "%s: vLLM ready in %.1f s (model %s, max_model_len %d)",
            self.name,
            self.start_s,
            self.model_path,
            self.max_model_len,
        )

    def _call(self, coro: Coroutine[Any, Any, T]) -> Awaitable[T]:
        """Run ``coro`` on the vLLM loop; awaitable from the caller's loop."""
        if self._vloop is None or self._vloop.is_closed():
            coro.close()
            raise StageError(f"{self.name}: not started", code="stage_failed")
        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._vloop))

    async def _start_engine(self, extra: dict[str, Any]) -> str:
        """Import vLLM, check the platform, spawn the engine with the options plus ``extra``
        engine arguments (vLLM loop). Returns the model path. Shared with the talker."""
        opts = self.options
        try:
            import vllm
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.platforms import current_platform
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as exc:
            raise ConfigError(
                f"engine.stages.{self.stage}.backend: vllm is not installed here ({exc}); "
                "use the vLLM venv (`make install-vllm`) or a GPU install"
            ) from None
        platform = str(current_platform.device_type)
        if opts.device != "auto" and opts.device != platform:
            raise ConfigError(
                f"{self.field}.device: {opts.device!r} requested, but the installed vLLM "
                f"{vllm.__version__} runs on {platform!r}"
            )
        model = self._resolve_model()
        kwargs = vo.engine_kwargs(opts, model, extra)
        accepted = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
        vo.check_engine_args(kwargs, accepted, str(vllm.__version__), self.field)
        loggers = [stat_logger_factory(self.figures)] if opts.log_stats else None
        try:
            with engine_env(vo.cpu_env(opts, platform), self._placement_env(platform)):
                args = AsyncEngineArgs(**kwargs)
                self._engine = AsyncLLM.from_engine_args(args, stat_loggers=loggers)
        except ConfigError:
            raise
        except Exception as exc:
            log.exception("%s: vLLM start-up failed", self.name)
            raise option_error(exc, self.field) from None
        self._tokenizer = self._engine.get_tokenizer()
        self.max_model_len = int(self._engine.model_config.max_model_len)
        return model

    async def _boot(self) -> None:
        """Spawn the engine and warm it up (vLLM loop; blocks only its thread)."""
        model = await self._start_engine({})
        # (probes of vLLM's own objects, which differ between its versions; not a backend's)
        if getattr(self._tokenizer, "chat_template", None) is None:
            raise ConfigError(f"{self.field}.model: {model} has no chat template")
        if self.options.warmup:
            warm = LlmRequest(
                request_id=f"{self.name}/warmup",
                messages=(ChatMessage(role="user", content="Hi"),),
                max_tokens=1,
            )
            async for _ in self._engine.generate(*self._inputs(warm)[:3]):
                pass

    def _placement_env(self, platform: str) -> dict[str, str]:
        """A pinned replica's EngineCore sees only its GPUs (engine/placement.py)."""
        kind = self.device.partition(":")[0]
        if kind != "auto" and kind != platform:
            raise ConfigError(
                f"engine.stages.{self.stage}.devices: replica {self.name} is placed on "
                f"{self.device!r}, but the installed vLLM runs on {platform!r}"
            )
        if self.gpus is None:
            return {}
        return {"CUDA_VISIBLE_DEVICES": self._child_visible()}

    def _resolve_model(self) -> str:
        self.model_path = vo.resolve_model(self.options.model, self.field, self.name)
        return self.model_path

    # ------------------------------------------------------------------ health
    def _engine_dead(self) -> str | None:
        """Why the running engine is dead (vLLM loop), or None."""
        engine = self._engine
        if engine is None or self._closing or not bool(engine.errored):
            return None
        return f"vLLM EngineCore died ({engine_exit(engine)})"

    def _request_error(self, exc: Exception) -> StageError:
        """A request's failure; a dead engine says so in words (``worker_died``)."""
        if type(exc).__name__ == "EngineDeadError":
            engine = self._engine
            how = engine_exit(engine) if engine is not None else "its process is gone"
            self.supervisor.suspect(f"vLLM EngineCore died ({how})")
            return StageError(f"{self.name}: vLLM EngineCore died ({how})", code="worker_died")
        return StageError(f"{self.name}: {type(exc).__name__}: {exc}", code="stage_failed")

    def _fail_all(self, reason: str) -> None:
        """Fail every request in flight (any thread): their streams end with ``reason``."""
        for job in list(self._jobs.values()):
            job.deliver(StageError(reason, code="worker_died"))
            job.deliver(_END)

    async def _restart_engine(self) -> None:
        """Replace a dead engine with a new one (vLLM loop)."""
        await self._shutdown_engine()
        self.figures.reset_gauges()
        started = time.perf_counter()
        await asyncio.wait_for(self._boot(), self.options.start_timeout_s)
        self.start_s = time.perf_counter() - started

    def engine_pid(self) -> int | None:
        """The pid of the running EngineCore process (tests kill it)."""
        return None if self._engine is None else engine_core_pid(self._engine)

    async def close(self) -> None:
        self._closing = True
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        for job in list(self._jobs.values()):
            self._end(job, StageDone(request_id=job.request_id, finish_reason="aborted"))
        loop, thread = self._vloop, self._thread
        if loop is None or thread is None or loop.is_closed():
            return
        if self._engine is not None:
            try:
                await self._call(self._shutdown_engine())
            except Exception:
                log.exception("%s: vLLM shutdown failed", self.name)
        try:
            loop.call_soon_threadsafe(loop.stop)
        except RuntimeError:
            pass
        await asyncio.to_thread(thread.join, 30.0)
        self._vloop = None
        self._thread = None

    async def _shutdown_engine(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.shutdown()
            release_zmq(engine)

    # ------------------------------------------------------------------ requests
    def _inputs(self, request: LlmRequest) -> tuple[Any, Any, str, int]:
        """(prompt, sampling params, request id, prompt tokens) for ``generate`` (vLLM loop)."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        ids, max_tokens = self._prompt_ids(request.messages, request.max_tokens)
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
        prompt = TokensPrompt(prompt_token_ids=ids)
        renderer = getattr(self._engine, "renderer", None)  # (vLLM's object: versions differ)
        if renderer is not None and hasattr(renderer, "render_cmpl"):
            # vLLM >= 0.3x: pre-rendered engine input (raw prompts are deprecated there).
            (engine_input,) = renderer.render_cmpl([prompt], renderer.default_cmpl_tok_params)
            return engine_input, params, request.request_id, len(ids)
        return prompt, params, request.request_id, len(ids)

    def _prompt_ids(
        self, messages: tuple[ChatMessage, ...], max_tokens: int
    ) -> tuple[list[int], int]:
        return fit_prompt(self._tokenizer, messages, max_tokens, self.max_model_len, self.name)

    async def _produce(self, request: LlmRequest, job: _Job) -> None:
        """Run one request on the engine; push its outputs to ``job`` (vLLM loop)."""
        rid = request.request_id
        try:
            prompt, params, _, n_prompt = self._inputs(request)
            realtime_first = self.options.scheduling_policy == "priority"
            reason: str | None = None
            async for out in self._engine.generate(
                prompt,
                params,
                rid,
                priority=int(request.priority) if realtime_first else 0,
            ):
                for completion in out.outputs[:1]:
                    job.tokens += len(completion.token_ids)
                    if completion.text:
                        job.deliver(TextOut(request_id=rid, text=completion.text))
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
            raise  # the consumer went away; vLLM aborts the request itself
        except StageError as exc:
            job.deliver(exc)
        except Exception as exc:
            log.exception("%s: request %s failed", self.name, rid)
            job.deliver(self._request_error(exc))
        finally:
            job.deliver(_END)

    def _end(self, job: _Job, last: StageDone) -> None:
        """End ``job``'s stream now (orchestrator loop); later outputs are dropped."""
        if not job.ended:
            job.ended = True
            job.out.put_nowait(last)
            job.out.put_nowait(_END)

    def _producer(self, request: StageRequest, job: _Job) -> Coroutine[Any, Any, None]:
        """The coroutine (run on the vLLM loop) that feeds ``job`` for ``request``; the
        talker overrides it."""
        if not isinstance(request, LlmRequest):
            raise StageError(f"{self.name}: expected an LlmRequest, got {type(request).__name__}")
        return self._produce(request, job)

    async def submit(self, request: StageRequest) -> AsyncIterator[StageOutput]:
        down = self.supervisor.health()
        if down is not None and not self._closing:
            raise StageError(down, code="stage_unavailable")
        if self._closing or self._engine is None or self._vloop is None:
            raise StageError(f"{self.name}: not running", code="stage_failed")
        rid = request.request_id
        if rid in self._jobs:
            raise StageError(f"{self.name}: request id {rid} is already running")
        job = _Job(request_id=rid, loop=asyncio.get_running_loop())
        coro = self._producer(request, job)
        self._jobs[rid] = job
        task = asyncio.run_coroutine_threadsafe(coro, self._vloop)
        try:
            while True:
                item = await job.out.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                if job.ended and not isinstance(item, StageDone):
                    continue  # aborted: never forward another chunk
                yield item
                if isinstance(item, StageDone):
                    return
        finally:
            self._jobs.pop(rid, None)
            if not task.done():
                task.cancel()  # cancels engine.generate there, which aborts it in vLLM

    async def abort(self, request_ids: Sequence[str]) -> None:
        ids = [rid for rid in request_ids if rid in self._jobs]
        for rid in ids:
            job = self._jobs[rid]
            self._end(job, StageDone(request_id=rid, finish_reason="aborted", tokens=job.tokens))
        if ids and self._engine is not None and self._vloop is not None:
            try:
                await self._call(self._engine.abort(ids))
            except Exception:
                log.exception("%s: vLLM abort of %s failed", self.name, ids)

    async def engine_requests(self) -> int:
        """Requests vLLM itself still holds (unfinished); 0 once every abort has landed."""
        if self._engine is None:
            return 0
        return await self._call(self._count_unfinished())

    async def _count_unfinished(self) -> int:
        return int(self._engine.get_num_unfinished_requests()) if self._engine else 0


__all__ = ["VllmLlm", "VllmOptions"]
