"""Start-up plumbing of the vLLM stages: the environment an EngineCore is spawned with.

vLLM's ``AsyncLLM`` spawns its EngineCore process from inside ``from_engine_args``, and the
child inherits this process's environment at that moment; there is no per-engine way to
give it a GPU. So :func:`engine_env` sets the child's variables in ``os.environ`` under one
**process-wide start lock**, and puts them back (and lets the next engine in) as soon as the
engine's process exists, or when the block ends, whichever comes first:

* two replicas pinned to ``cuda:0`` and ``cuda:1`` that start together each spawn with their
  own ``CUDA_VISIBLE_DEVICES`` (one waits for the other's spawn, not for its whole start-up);
* ``pinned`` variables are always set for the child (the caller has checked them against a
  preset value, engine/placement.py); ``defaults`` only when the environment lacks them
  (``OMP_NUM_THREADS`` and ``VLLM_ENABLE_V1_MULTIPROCESSING`` on the CPU build);
* ``pinned`` may be a function, called **under the lock**: the replica's
  ``CUDA_VISIBLE_DEVICES`` is derived from this process's own value, which another replica's
  spawn replaces while it holds the lock (read before it, a replica pinned to ``cuda:0``
  could take the other replica's ``cuda:1``; :meth:`VllmPlacement.env` is passed so).

While the lock is held this process's own ``os.environ`` shows the child's values; torch in
this process has read ``CUDA_VISIBLE_DEVICES`` once, when CUDA initialised (the backend table's
``cuda_device_count`` does that before any stage starts), so its devices do not move.

Also here: :class:`VllmPlacement` (a replica's GPUs and the variables its EngineCore gets),
the mapping of vLLM's start-up errors to the option they name, and the release of a vLLM
client's ZMQ context.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from duplex_contract.errors import ConfigError
from engine.placement import child_visible_devices, replica_gpus
from engine.stages import vllm_options as vo
from engine.stages.vllm_options import VllmOptions

log = logging.getLogger(__name__)

#: held from setting an EngineCore's environment until its process exists
START_LOCK = threading.Lock()
ENGINE_PROCESS_PREFIX = "EngineCore"  # vLLM's name for the engine process (EngineCore_DP0)

# vLLM EngineArgs names (as they appear in its error messages) -> our option names.
_FIELD_HINTS: tuple[tuple[str, str], ...] = (
    ("max_model_len", "max_model_len"),
    ("max-model-len", "max_model_len"),
    ("gpu_memory_utilization", "gpu_memory_utilization"),
    ("gpu-memory-utilization", "gpu_memory_utilization"),
    ("kv_cache_memory", "kv_cache_memory_gib"),
    ("KV cache", "kv_cache_memory_gib"),
    ("max_num_seqs", "max_num_seqs"),
    ("max_num_batched_tokens", "max_num_batched_tokens"),
    ("tensor_parallel_size", "tensor_parallel_size"),
    ("dtype", "dtype"),
    ("tokenizer", "tokenizer"),
)


def option_error(exc: BaseException, field: str) -> ConfigError:
    """A vLLM start-up failure as a ConfigError naming the option it is about."""
    text = f"{type(exc).__name__}: {exc}".strip()
    for needle, option in _FIELD_HINTS:
        if needle in text:
            return ConfigError(f"{field}.{option}: vLLM refused it: {text}")
    return ConfigError(f"{field}: vLLM failed to start: {text}")


def child_pids() -> set[int]:
    """Pids of this process's live ``multiprocessing`` children."""
    return {p.pid for p in multiprocessing.active_children() if p.pid is not None}


def engine_spawned(before: set[int]) -> Callable[[], bool]:
    """A check that turns true once a vLLM engine process not in ``before`` exists."""

    def check() -> bool:
        return any(
            p.pid is not None and p.pid not in before and p.name.startswith(ENGINE_PROCESS_PREFIX)
            for p in multiprocessing.active_children()
        )

    return check


class _Scope:
    """The variables one engine's spawn needs, set until :meth:`release` (once)."""

    def __init__(self, defaults: Mapping[str, str], pinned: Mapping[str, str]) -> None:
        self._once = threading.Lock()
        self._released = False
        self._saved = {key: os.environ.get(key) for key in pinned}
        self._added = [key for key in defaults if key not in os.environ and key not in pinned]
        for key in self._added:
            os.environ[key] = defaults[key]
        for key, value in pinned.items():
            os.environ[key] = value

    def release(self) -> None:
        with self._once:
            if self._released:
                return
            self._released = True
            for key in self._added:
                os.environ.pop(key, None)
            for key, old in self._saved.items():
                if old is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = old
            START_LOCK.release()

    @property
    def released(self) -> bool:
        return self._released


@contextlib.contextmanager
def engine_env(
    defaults: Mapping[str, str],
    pinned: Mapping[str, str] | Callable[[], Mapping[str, str]],
    *,
    spawned: Callable[[], bool] | None = None,
    poll_s: float = 0.02,
) -> Iterator[None]:
    """Run the block with the environment an engine process must inherit (see the module
    docstring). ``pinned``: the variables, or a function that gives them, called once the
    lock is held. ``spawned`` tells when the engine's process exists (default: a new
    ``EngineCore*`` child of this process); the lock and the variables are released then,
    or at the end of the block."""
    START_LOCK.acquire()
    try:
        scope = _Scope(defaults, pinned() if callable(pinned) else pinned)
    except BaseException:
        START_LOCK.release()
        raise
    check = spawned or engine_spawned(child_pids())
    done = threading.Event()

    def watch() -> None:
        while not done.wait(poll_s):
            try:
                if check():
                    scope.release()
                    return
            except Exception:  # a broken check must not keep the lock: release at the end
                log.exception("watching for the vLLM engine process failed")
                return

    watcher = threading.Thread(target=watch, name="vllm-spawn-watch", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()
        scope.release()


def release_zmq(engine: Any) -> None:
    """Terminate the ZMQ context of the engine client (vLLM 0.32's ``shutdown`` closes the
    sockets but leaves the context to the GC, which warns ``Unclosed context``). Its
    ``zmq.asyncio.Context`` shadows a sync context that owns the handle: close the shadow's
    sockets, then destroy the owner. Best effort (cleanup)."""
    try:  # (probes of vLLM's and pyzmq's internals, not of a stage backend)
        ctx = getattr(getattr(engine, "engine_core", None), "ctx", None)
        if ctx is None:
            return
        owner = getattr(ctx, "_shadow_obj", None) or ctx
        for sock in list(getattr(ctx, "_sockets", ())):
            sock.close(linger=0)
        if not owner.closed:
            owner.destroy(linger=0)
    except Exception:
        log.exception("releasing the vLLM client's ZMQ context failed")


class VllmPlacement:
    """Where one vLLM replica's engine runs: the GPUs it is pinned to (``gpus``; None: vLLM
    places itself), the devices it holds while it starts, and the ``CUDA_VISIBLE_DEVICES``
    its EngineCore is spawned with. Everything is checked when it is built (a ConfigError
    naming the option), before any engine starts."""

    def __init__(
        self, options: VllmOptions, *, name: str, stage: str, device: str, cuda_count: int
    ) -> None:
        self.name = name
        self.stage = stage
        self.device = device  # the replica's placement: auto, cpu or cuda:N
        self.cuda_count = cuda_count  # GPUs CUDA shows here (0 for a cpu replica)
        vo.check_parallel(
            options,
            field=f"engine.stages.{stage}.options",
            device=device,
            cuda_count=cuda_count,
            has_ray=options.distributed_executor_backend != "ray" or vo.ray_installed(),
        )
        self.gpus = replica_gpus(
            device=device,
            device_ids=options.device_ids,
            tensor_parallel_size=vo.workers(options),  # one GPU per worker (tp x pp x dp)
            cuda_count=cuda_count,
            where=f"engine.stages.{stage}",
            replica=name,
        )
        if self.gpus is not None:
            self.child_visible()

    def start_devices(self) -> frozenset[str]:
        """The GPUs the replica takes while it starts (engine/startup.py orders by them)."""
        if self.gpus is not None:
            return frozenset(f"cuda:{i}" for i in self.gpus)
        if self.device == "auto":  # vLLM places itself: on every GPU there is
            return frozenset(f"cuda:{i}" for i in range(self.cuda_count))
        return frozenset()

    def child_visible(self) -> str:
        """``CUDA_VISIBLE_DEVICES`` for the pinned replica's EngineCore."""
        assert self.gpus is not None
        return child_visible_devices(
            self.gpus,
            os.environ.get("CUDA_VISIBLE_DEVICES"),
            where=f"engine.stages.{self.stage}.devices",
            replica=self.name,
        )

    def env(self, platform: str) -> dict[str, str]:
        """The variables pinned for the EngineCore (engine/placement.py); refuses a replica
        placed on a device kind the installed vLLM does not run on."""
        kind = self.device.partition(":")[0]
        if kind != "auto" and kind != platform:
            raise ConfigError(
                f"engine.stages.{self.stage}.devices: replica {self.name} is placed on "
                f"{self.device!r}, but the installed vLLM runs on {platform!r}"
            )
        if self.gpus is None:
            return {}
        return {"CUDA_VISIBLE_DEVICES": self.child_visible()}
