"""vLLM's own figures for ``/metrics``, and what a dead engine's process left behind.

With ``log_stats`` on (the default) each vLLM stage passes a stat logger of its own to
``AsyncLLM.from_engine_args(stat_loggers=...)`` (vLLM v1's custom stat logger API): every
engine step's ``SchedulerStats`` (running and waiting requests, KV cache use) and
``IterationStats`` (prompt and generated tokens, queue time of finished requests) land in an
:class:`EngineFigures`, read by the engine's stats at scrape time. vLLM calls the loggers on
the replica's own loop thread; the figures are guarded by a lock.

vLLM documents these stats classes as unstable across versions, so their fields are read
with defaults (a field a version lacks reads as 0), and its stat logger base class is
imported only when an engine starts.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from engine.stage_figures import StageEngineFigures

__all__ = ["EngineFigures", "engine_core_pid", "engine_exit", "stat_logger_factory"]

_RATE_WINDOW_S = 5.0  # tokens/s is measured over the last few seconds


class EngineFigures:
    """What one replica's engine last reported; thread-safe."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self.running = 0
        self.waiting = 0
        self.kv_cache_usage = 0.0
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self._samples: deque[tuple[float, int]] = deque()  # (time, generated_tokens)
        self.on_wait: Callable[[float], None] | None = None  # queue time of each request

    def record(self, scheduler: Any, iteration: Any) -> None:
        """One step's stats (vLLM's ``SchedulerStats`` / ``IterationStats``, either None)."""
        now = self._clock()
        waits: list[float] = []
        # (probes of vLLM's stats objects, whose fields differ between its versions)
        with self._lock:
            if scheduler is not None:
                self.running = int(getattr(scheduler, "num_running_reqs", 0))
                self.waiting = int(getattr(scheduler, "num_waiting_reqs", 0))
                usage: Any = getattr(scheduler, "kv_cache_usage", None)
                if usage is None:  # older name
                    usage = getattr(scheduler, "gpu_cache_usage", 0.0)
                self.kv_cache_usage = float(usage)
            if iteration is not None:
                self.prompt_tokens += int(getattr(iteration, "num_prompt_tokens", 0))
                self.generated_tokens += int(getattr(iteration, "num_generation_tokens", 0))
                for done in getattr(iteration, "finished_requests", ()):
                    queued = getattr(done, "queued_time", None)
                    if queued is not None:
                        waits.append(float(queued))
            self._samples.append((now, self.generated_tokens))
            while len(self._samples) > 2 and now - self._samples[1][0] > _RATE_WINDOW_S:
                self._samples.popleft()
        hook = self.on_wait
        if hook is not None:
            for seconds in waits:
                hook(seconds)

    def tokens_per_s(self) -> float:
        with self._lock:
            return self._rate(self._clock())

    def _rate(self, now: float) -> float:
        if not self._samples:
            return 0.0
        t0, n0 = self._samples[0]
        if now - self._samples[-1][0] > _RATE_WINDOW_S:  # idle: nothing generated lately
            return 0.0
        span = now - t0
        return (self.generated_tokens - n0) / span if span > 0 else 0.0

    def snapshot(self) -> StageEngineFigures:
        with self._lock:
            return StageEngineFigures(
                running=self.running,
                waiting=self.waiting,
                kv_cache_usage=self.kv_cache_usage,
                prompt_tokens=self.prompt_tokens,
                generated_tokens=self.generated_tokens,
                tokens_per_s=self._rate(self._clock()),
            )

    def reset_gauges(self) -> None:
        """The engine is gone: nothing runs or waits in it any more."""
        with self._lock:
            self.running = self.waiting = 0
            self.kv_cache_usage = 0.0


def stat_logger_factory(figures: EngineFigures) -> Callable[[Any, int], Any]:
    """A vLLM ``StatLoggerFactory`` whose loggers write into ``figures``."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _Logger(StatLoggerBase):  # type: ignore[misc, unused-ignore]  # (Any without vLLM)
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(self, scheduler_stats: Any, iteration_stats: Any, *_: Any, **__: Any) -> None:
            figures.record(scheduler_stats, iteration_stats)

        def log_engine_initialized(self) -> None:
            pass

    def make(vllm_config: Any, engine_index: int = 0) -> Any:
        return _Logger(vllm_config, engine_index)

    return make


def _processes(engine: Any) -> list[Any]:
    # (probes of vLLM's internals, which differ between its versions)
    resources = getattr(getattr(engine, "engine_core", None), "resources", None)
    manager = getattr(resources, "engine_manager", None)
    return list(getattr(manager, "processes", ()) or ())


def engine_core_pid(engine: Any) -> int | None:
    """The pid of ``engine``'s (first) EngineCore process, when vLLM runs one."""
    for proc in _processes(engine):
        pid = getattr(proc, "pid", None)
        if pid is not None:
            return int(pid)
    return None


def engine_exit(engine: Any) -> str:
    """How ``engine``'s EngineCore process ended, in words."""
    codes = [getattr(p, "exitcode", None) for p in _processes(engine)]
    ended = [c for c in codes if c is not None]
    if not ended:
        return "its process is gone or stopped answering"
    code = ended[0]
    if code < 0:
        return f"its process was killed by signal {-code}"
    return f"its process exited with code {code}"
