"""Per-stage figures a backend may report for ``/metrics``, and the interfaces it implements.

Four optional interfaces (a backend implements what it can measure; the stage pool wires
them, engine/stages/pool.py ``StagePool``):

* :class:`StepSource` - ``on_step(batch_size)``: requests advanced together by one step;
* :class:`QueueWaitSource` - ``on_wait(seconds)``: a request waited this long between its
  submit and the start of its work (the worker runtimes; vLLM's scheduler queue time);
* :class:`DecodeSource` - ``on_decode(busy_s, audio_s)``: one decoder call took ``busy_s``
  for ``audio_s`` of audio (the SNAC codec);
* :class:`EngineFiguresSource` - ``engine_figures()``: what an engine's own scheduler
  reports (running and waiting requests, KV cache use, tokens; the vLLM stages).

:func:`stage_engine_figures` sums a stage's replicas into one :class:`StageEngineFigures`
(requests and tokens added up, the KV cache use of the fullest replica).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

__all__ = [
    "DecodeSource",
    "EngineFiguresSource",
    "QueueWaitSource",
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
        )
    return out
