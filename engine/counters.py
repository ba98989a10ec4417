"""Cumulative engine figures the server exports as metrics (written by the orchestrator
and stage workers, read and drained from the server's thread)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

_KEEP = 10_000  # undrained samples kept (the oldest half is dropped beyond this)


@dataclass
class Counters:
    stale_dropped: int = 0
    stage_latency: list[tuple[str, float]] = field(default_factory=list)
    stage_steps: list[tuple[str, int]] = field(default_factory=list)  # (stage, batch size)
    #: (stage, seconds a request waited in the stage's queue before it joined a step)
    stage_queue_wait: list[tuple[str, float]] = field(default_factory=list)
    #: bytes held for live sessions by part, all sessions summed (the reaper refreshes it)
    session_bytes: dict[str, int] = field(default_factory=dict)
    #: speculative responses (engine/drafts.py): started, used (adopted), dropped
    drafts: dict[str, int] = field(default_factory=lambda: {"started": 0, "used": 0, "dropped": 0})
    #: of the dropped drafts, those that left a full stage to a real-time request
    #: (engine/scheduling.py, policy capacity)
    drafts_yielded: int = 0
    heap_trims: int = 0  # free heap pages given back to the OS (engine/heap.py)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def latency(self, stage: str, seconds: float) -> None:
        """A stage request produced its first output ``seconds`` after it was submitted."""
        with self.lock:
            self.stage_latency.append((stage, seconds))
            if len(self.stage_latency) > _KEEP:
                del self.stage_latency[: _KEEP // 2]

    def step(self, stage: str, size: int) -> None:
        """A batching stage ran one step over ``size`` requests (called from its worker)."""
        with self.lock:
            self.stage_steps.append((stage, size))
            if len(self.stage_steps) > _KEEP:
                del self.stage_steps[: _KEEP // 2]

    def queue_wait(self, stage: str, seconds: float) -> None:
        """A request waited ``seconds`` in ``stage``'s queue before its first step or call
        (reported by stages that know it: the sim stage)."""
        with self.lock:
            self.stage_queue_wait.append((stage, seconds))
            if len(self.stage_queue_wait) > _KEEP:
                del self.stage_queue_wait[: _KEEP // 2]

    def drain_queue_waits(self) -> list[tuple[str, float]]:
        with self.lock:
            out, self.stage_queue_wait = self.stage_queue_wait, []
        return out

    def drain_latencies(self) -> list[tuple[str, float]]:
        with self.lock:
            out, self.stage_latency = self.stage_latency, []
        return out

    def drain_steps(self) -> list[tuple[str, int]]:
        with self.lock:
            out, self.stage_steps = self.stage_steps, []
        return out
