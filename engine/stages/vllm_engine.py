"""One vLLM ``AsyncLLM`` on a private loop thread: the engine both vLLM stages hold.

vLLM runs the model in its own EngineCore process (always, for ``AsyncLLM``; spawned on CPU,
so scripts need a ``__main__`` guard) and schedules every running request in one continuous
batch, so concurrent requests from different sessions share each forward pass. A
:class:`VllmEngine` is the plumbing around one such engine that the text LM
(engine/stages/llm_vllm.py) and the talker (engine/stages/talker_vllm.py) share:

* threading: the ``AsyncLLM`` front end (tokenizer, detokenizer, output processing) lives on
  a private event loop in a thread of its own, never on the orchestrator's loop; start-up
  (import, engine spawn, warm-up) and shutdown block only that thread. A request's outputs
  come back through a :class:`RequestStream` (engine/stages/vllm_loop.py);
* start-up: the options become engine arguments (engine/stages/vllm_options.py), spawned in
  the replica's placement (:class:`VllmPlacement`); errors are :class:`ConfigError` naming
  the option; what is model-specific (which model, extra engine arguments, checks and a
  warm-up) is asked of the stage (:class:`VllmModel`);
* supervision (engine/stages/supervisor.py): a dead EngineCore fails the requests in
  flight and is restarted; vLLM's scheduler figures for ``/metrics`` (engine/stages/
  vllm_stats.py);
* requests: ``submit`` runs the stage's producer for one request on the vLLM loop; ``abort``
  ends the stream at once (``StageDone("aborted")``, nothing later is forwarded) and aborts
  the request in vLLM; :meth:`VllmEngine.generate_into` runs a prompt and ends the stream
  with ``StageDone(finish_reason, tokens)``. The vLLM request id is the stage request id,
  which embeds the fence (``sess_x/e3/t5/r1/llm``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from typing import Any, Literal, Protocol, TypeVar

from duplex_contract.errors import ConfigError, StageError
from engine.messages import StageDone, StageOutput, StageRequest
from engine.stages import vllm_options as vo
from engine.stages.supervisor import Supervisor
from engine.stages.vllm_env import VllmPlacement, engine_env, option_error, release_zmq
from engine.stages.vllm_loop import RequestStream, run_loop
from engine.stages.vllm_options import VllmOptions
from engine.stages.vllm_stats import (
    EngineFigures,
    engine_core_pid,
    engine_exit,
    stat_logger_factory,
)

log = logging.getLogger(__name__)

T = TypeVar("T")


def torch_cuda_devices() -> int:
    """CUDA devices torch sees here (0 without torch): what a vLLM stage can use."""
    try:
        import torch
    except ImportError:
        return 0
    return int(torch.cuda.device_count())


class VllmModel(Protocol):
    """What a vLLM stage tells the engine it holds (called on the vLLM loop at start-up
    and at every restart)."""

    def resolve_model(self) -> str:
        """The model directory to load (a ConfigError naming ``model`` when there is none)."""
        ...

    def engine_args(self) -> dict[str, Any]:
        """Engine arguments beyond the options' (e.g. a logits processor)."""
        ...

    async def warm_up(self, model: str) -> None:
        """Check the started engine for this stage and run a first request."""
        ...


class VllmEngine:
    """One ``AsyncLLM`` of a vLLM stage replica (see the module docstring).

    ``supervisor`` (restarts, health) and ``figures`` (vLLM's scheduler stats) are its
    parts; ``llm`` is the running ``AsyncLLM`` (None while there is none), ``tokenizer`` and
    ``max_model_len`` its model's."""

    def __init__(
        self,
        options: VllmOptions,
        name: str,
        *,
        stage: str,
        placement: VllmPlacement,
        model: VllmModel,
    ) -> None:
        self.options = options
        self.name = name
        self.stage = stage
        self.field = f"engine.stages.{stage}.options"  # named in start-up errors
        self.placement = placement
        self._model = model
        self.supervisor = Supervisor(
            name,
            probe=self._engine_dead,
            fail_requests=self._fail_all,
            restart=self._restart,
            max_restarts=options.max_restarts,
            interval_s=options.health_interval_s,
            backoff_s=options.restart_backoff_s,
        )
        self.figures = EngineFigures()  # vLLM's scheduler stats, for /metrics
        self._watch: concurrent.futures.Future[None] | None = None
        self.model_path: str | None = None
        self.max_model_len = 0
        self.start_s = 0.0  # engine start-up time (spawn + load + warm-up), measured
        self.llm: Any = None
        self.tokenizer: Any = None
        self._streams: dict[str, RequestStream] = {}
        self._vloop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._closing = False

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
            await asyncio.wait_for(self.call(self._boot()), self.options.start_timeout_s)
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

    def call(self, coro: Coroutine[Any, Any, T]) -> Awaitable[T]:
        """Run ``coro`` on the vLLM loop; awaitable from the caller's loop."""
        if self._vloop is None or self._vloop.is_closed():
            coro.close()
            raise StageError(f"{self.name}: not started", code="stage_failed")
        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._vloop))

    async def _spawn(self, extra: dict[str, Any]) -> str:
        """Import vLLM, check the platform, spawn the engine with the options plus ``extra``
        engine arguments (vLLM loop). Returns the model path."""
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
        model = self.model_path = self._model.resolve_model()
        kwargs = vo.engine_kwargs(opts, model, extra)
        accepted = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
        vo.check_engine_args(kwargs, accepted, str(vllm.__version__), self.field)
        loggers = [stat_logger_factory(self.figures)] if opts.log_stats else None
        try:
            # read under the start lock: another replica's spawn changes this process's
            # CUDA_VISIBLE_DEVICES while it holds it (engine/stages/vllm_env.py)
            pinned = functools.partial(self.placement.env, platform)
            with engine_env(vo.cpu_env(opts, platform), pinned):
                args = AsyncEngineArgs(**kwargs)
                self.llm = AsyncLLM.from_engine_args(args, stat_loggers=loggers)
        except ConfigError:
            raise
        except Exception as exc:
            log.exception("%s: vLLM start-up failed", self.name)
            raise option_error(exc, self.field) from None
        self.tokenizer = self.llm.get_tokenizer()
        self.max_model_len = int(self.llm.model_config.max_model_len)
        return model

    async def _boot(self) -> None:
        """Spawn the engine and warm it up (vLLM loop; blocks only its thread)."""
        model = await self._spawn(self._model.engine_args())
        await self._model.warm_up(model)

    async def _restart(self) -> None:
        """Replace a dead engine with a new one (vLLM loop)."""
        await self._shutdown()
        self.figures.reset_gauges()
        started = time.perf_counter()
        await asyncio.wait_for(self._boot(), self.options.start_timeout_s)
        self.start_s = time.perf_counter() - started

    async def close(self) -> None:
        self._closing = True
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        for stream in list(self._streams.values()):
            stream.end(StageDone(request_id=stream.request_id, finish_reason="aborted"))
        loop, thread = self._vloop, self._thread
        if loop is None or thread is None or loop.is_closed():
            return
        if self.llm is not None:
            try:
                await self.call(self._shutdown())
            except Exception:
                log.exception("%s: vLLM shutdown failed", self.name)
        try:
            loop.call_soon_threadsafe(loop.stop)
        except RuntimeError:
            pass
        await asyncio.to_thread(thread.join, 30.0)
        self._vloop = None
        self._thread = None

    async def _shutdown(self) -> None:
        engine, self.llm = self.llm, None
        if engine is not None:
            engine.shutdown()
            release_zmq(engine)

    # ------------------------------------------------------------------ health
    def _engine_dead(self) -> str | None:
        """Why the running engine is dead (vLLM loop), or None."""
        engine = self.llm
        if engine is None or self._closing or not bool(engine.errored):
            return None
        return f"vLLM EngineCore died ({engine_exit(engine)})"

    def request_error(self, exc: Exception) -> StageError:
        """A request's failure; a dead engine says so in words (``worker_died``)."""
        if type(exc).__name__ == "EngineDeadError":
            engine = self.llm
            how = engine_exit(engine) if engine is not None else "its process is gone"
            self.supervisor.suspect(f"vLLM EngineCore died ({how})")
            return StageError(f"{self.name}: vLLM EngineCore died ({how})", code="worker_died")
        return StageError(f"{self.name}: {type(exc).__name__}: {exc}", code="stage_failed")

    def _fail_all(self, reason: str) -> None:
        """Fail every request in flight (any thread): their streams end with ``reason``."""
        for stream in list(self._streams.values()):
            stream.fail(StageError(reason, code="worker_died"))

    def pid(self) -> int | None:
        """The pid of the running EngineCore process (tests kill it)."""
        return None if self.llm is None else engine_core_pid(self.llm)

    # ------------------------------------------------------------------ requests
    async def submit(
        self,
        request: StageRequest,
        producer: Callable[[StageRequest, RequestStream], Coroutine[Any, Any, None]],
    ) -> AsyncIterator[StageOutput]:
        """Stream ``request``'s outputs: ``producer(request, stream)`` is the coroutine, run
        on the vLLM loop, that feeds them (it raises a StageError for a request it can't
        serve)."""
        down = self.supervisor.health()
        if down is not None and not self._closing:
            raise StageError(down, code="stage_unavailable")
        if self._closing or self.llm is None or self._vloop is None:
            raise StageError(f"{self.name}: not running", code="stage_failed")
        rid = request.request_id
        if rid in self._streams:
            raise StageError(f"{self.name}: request id {rid} is already running")
        stream = RequestStream(request_id=rid, loop=asyncio.get_running_loop())
        coro = producer(request, stream)
        self._streams[rid] = stream
        task = asyncio.run_coroutine_threadsafe(coro, self._vloop)
        try:
            async for item in stream.outputs():
                yield item
        finally:
            self._streams.pop(rid, None)
            if not task.done():
                task.cancel()  # cancels engine.generate there, which aborts it in vLLM

    async def abort(self, request_ids: Sequence[str]) -> None:
        ids = [rid for rid in request_ids if rid in self._streams]
        for rid in ids:
            stream = self._streams[rid]
            stream.end(StageDone(request_id=rid, finish_reason="aborted", tokens=stream.tokens))
        if ids and self.llm is not None and self._vloop is not None:
            try:
                await self.call(self.llm.abort(ids))
            except Exception:
                log.exception("%s: vLLM abort of %s failed", self.name, ids)

    def engine_input(self, prompt: Any) -> Any:
        """``prompt`` as ``generate`` takes it: pre-rendered where vLLM has a renderer (vLLM
        >= 0.3x deprecates raw prompts there)."""
        renderer = getattr(self.llm, "renderer", None)  # (vLLM's object: versions differ)
        if renderer is not None and hasattr(renderer, "render_cmpl"):
            (engine_input,) = renderer.render_cmpl([prompt], renderer.default_cmpl_tok_params)
            return engine_input
        return prompt

    async def generate_into(
        self,
        stream: RequestStream,
        request: StageRequest,
        inputs: Callable[[], tuple[Any, Any, int]],
        each: Callable[[Any], None],
    ) -> None:
        """Run one request on the engine and feed ``stream`` (vLLM loop): ``inputs()`` gives
        (prompt, sampling params, prompt tokens), ``each`` handles every step's completion
        (it counts ``stream.tokens`` and delivers outputs; a StageError it raises fails the
        request); the stream ends with ``StageDone(finish_reason, tokens)``."""
        rid = request.request_id
        try:
            prompt, params, n_prompt = inputs()
            realtime_first = self.options.scheduling_policy == "priority"
            reason: str | None = None
            async for out in self.llm.generate(
                prompt, params, rid, priority=int(request.priority) if realtime_first else 0
            ):
                for completion in out.outputs[:1]:
                    each(completion)
                    if out.finished:
                        reason = completion.finish_reason
            finish: Literal["stop", "length", "aborted"]
            if reason == "abort":
                finish = "aborted"
            elif reason in ("stop", "length"):
                finish = "stop" if reason == "stop" else "length"
            else:
                raise StageError(f"{self.name}: request ended with {reason!r}")
            stream.deliver(
                StageDone(
                    request_id=rid,
                    finish_reason=finish,
                    tokens=stream.tokens,
                    prompt_tokens=n_prompt,
                )
            )
        except asyncio.CancelledError:
            raise  # the consumer went away; vLLM aborts the request itself
        except StageError as exc:
            stream.deliver(exc)
        except Exception as exc:
            log.exception("%s: request %s failed", self.name, rid)
            stream.deliver(self.request_error(exc))
        finally:
            stream.finish()

    async def unfinished(self) -> int:
        """Requests vLLM itself still holds (unfinished); 0 once every abort has landed."""
        if self.llm is None:
            return 0
        return await self.call(self._count_unfinished())

    async def _count_unfinished(self) -> int:
        return int(self.llm.get_num_unfinished_requests()) if self.llm else 0

    async def held_request_ids(self) -> list[str]:
        """The (external) ids of the requests vLLM itself still holds: what an abort must
        have removed (tests check barge-ins here, not in our own bookkeeping)."""
        if self.llm is None:
            return []
        return await self.call(self._held_ids())

    async def _held_ids(self) -> list[str]:
        # (probes of vLLM's internals, which differ between its versions; not a backend's)
        states = getattr(getattr(self.llm, "output_processor", None), "request_states", {})
        return sorted(str(getattr(s, "external_req_id", None) or k) for k, s in states.items())
