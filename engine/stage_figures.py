"""Per-stage figures a backend may report for ``/metrics``, and the interfaces it implements.

Four optional interfaces (a backend implements what it can measure; the stage pool wires
them, engine/stages/pool.py ``StagePool``):

* :class:`StepSource` - ``on_step(batch_size)``: requests advanced together by one step;
* :class:`QueueWaitSource` - ``on_wait(seconds)``: a request waited this long between its
  submit and the start of its work (the worker runtimes; vLLM's scheduler queue time);
* :class:`DecodeSource` - ``on_decode(busy_s, audio_s)``: one decoder call took ``busy_s``
  for ``audio_s`` of audio (the SNAC codec);
* :class:`EngineFiguresSource` - ``engine_figures()``: what an engine's own scheduler
  reports (running and waiting requests, KV cache use, tokens; the vLLM stages);
* :class:`PaceSource` - ``pace()``: how fast the replica advances each of its live streams
  against what real time needs (:class:`Pace`; the talkers, the sim's decode stages). The
  scheduling policy reads it (engine/orchestration/capacity.py).

:class:`SchedulingFigures` is one stage's state in the scheduling policy, for ``/metrics``.

:func:`stage_engine_figures` sums a stage's replicas into one :class:`StageEngineFigures`
(requests and tokens added up, the KV cache use of the fullest replica).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

__all__ = [
    "WAIT_BOUNDS",
    "DecodeSource",
    "EngineFiguresSource",
    "Pace",
    "PaceSource",
    "QueueWaitSource",
    "SchedulingFigures",
    "StageEngineFigures",
    "StepSource",
    "stage_engine_figures",
]


@dataclass(frozen=True)
class StageEngineFigures:
    running: int = 0  # requests in the engine's running batch
    waiting: int = 0  # requests queued in the engine's scheduler
    kv_cache_usage: float = 0.0  # 0..1, the fullest replica
    prompt_tokens: int = 0  # cumulative
    generated_tokens: int = 0  # cumulative
    tokens_per_s: float = 0.0  # generated, over the last few seconds
    busy_s: float = 0.0  # device time its calls and steps took (cumulative; the sim stage)


@dataclass(frozen=True)
class Pace:
    """A replica's real-time budget now: ``streams`` live streams each get ``rate`` units per
    second (tokens, frames; measured over the last moments), and each needs ``need`` to keep
    up with the audio it becomes. ``limit``: the most streams it keeps in real time by its
    cost model, alone on its device (0: not known)."""

    streams: int
    rate: float
    need: float
    limit: int = 0

    @property
    def ratio(self) -> float:
        """Delivered over needed: below 1 the live streams fall behind real time."""
        return self.rate / self.need if self.need > 0 else float("inf")


@runtime_checkable
class PaceSource(Protocol):
    def pace(self) -> Pace | None:
        """Its pace now; None when it has no live stream to measure (or cannot tell)."""
        ...


#: upper bounds (s) of the buckets of a batch request's wait to be admitted to a stage
WAIT_BOUNDS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


@dataclass(frozen=True)
class SchedulingFigures:
    """One stage in the scheduling policy (engine/orchestration/scheduling.py), as
    ``/metrics`` shows it: gauges of now, and cumulative counts."""

    capacity: int = 0  # request slots (replicas x batch, or the config's)
    limit: int = 0  # slots it admits to: capacity, or fewer by its real-time budget
    reserve: int = 0  # slots batch work, guesses and drafts leave free
    in_flight: dict[str, int] = field(default_factory=dict)  # by kind
    realtime_waiting: int = 0  # real-time requests before their first output
    batch_waiting: int = 0  # batch requests waiting to be admitted
    pace: float = 0.0  # its slowest replica's Pace.ratio (0: not known)
    batch_waits: int = 0  # batch requests that had to wait (cumulative)
    batch_aged: int = 0  # ... admitted by the minimum-share guard
    batch_timeouts: int = 0  # ... refused with server_busy after engine.scheduling.batch_wait_s
    drafts_yielded: int = 0  # drafts asked to leave for a real-time request
    #: cumulative batch admission waits: counts per bucket of ``wait_bounds`` (upper bounds,
    #: s; not cumulative across buckets), the count past the last bound, and their sum (s)
    wait_bounds: tuple[float, ...] = WAIT_BOUNDS
    wait_buckets: tuple[int, ...] = ()
    wait_sum_s: float = 0.0
    #: outputs the stage produced, by use: realtime, draft_used, draft_wasted (of drafts
    #: discarded unadopted), speculative, batch (cumulative)
    outputs: dict[str, int] = field(default_factory=dict)


@runtime_checkable
class StepSource(Protocol):
    """``on_step(batch_size)``: one step or call advanced this many requests together (the
    batching runtime, the sim stage)."""

    on_step: Callable[[int], None] | None


@runtime_checkable
class QueueWaitSource(Protocol):
    on_wait: Callable[[float], None] | None


@runtime_checkable
class DecodeSource(Protocol):
    on_decode: Callable[[float, float], None] | None


@runtime_checkable
class EngineFiguresSource(Protocol):
    def engine_figures(self) -> StageEngineFigures: ...


def stage_engine_figures(
    replicas_by_stage: Mapping[str, Iterable[object]],
) -> dict[str, StageEngineFigures]:
    """One figure per stage that has a replica reporting engine figures."""
    out: dict[str, StageEngineFigures] = {}
    for stage, replicas in replicas_by_stage.items():
        figs = [r.engine_figures() for r in replicas if isinstance(r, EngineFiguresSource)]
        if not figs:
            continue
        out[stage] = StageEngineFigures(
            running=sum(f.running for f in figs),
            waiting=sum(f.waiting for f in figs),
            kv_cache_usage=max(f.kv_cache_usage for f in figs),
            prompt_tokens=sum(f.prompt_tokens for f in figs),
            generated_tokens=sum(f.generated_tokens for f in figs),
            tokens_per_s=sum(f.tokens_per_s for f in figs),
            busy_s=sum(f.busy_s for f in figs),
        )
    return out
