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
    stage_waits: list[tuple[str, float]] = field(default_factory=list)  # (stage, queue wait s)
    #: (stage, decoder seconds, audio seconds) per decoder step (the codec)
    stage_decodes: list[tuple[str, float, float]] = field(default_factory=list)
    #: bytes held for live sessions by part, all sessions summed (the reaper refreshes it)
    session_bytes: dict[str, int] = field(default_factory=dict)
    #: speculative responses (engine/orchestration/drafts.py): started, used (adopted), dropped
    drafts: dict[str, int] = field(default_factory=lambda: {"started": 0, "used": 0, "dropped": 0})
    #: of the dropped drafts, those that left a full stage to a real-time request
    #: (engine/orchestration/scheduling.py, policy capacity)
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

    def wait(self, stage: str, seconds: float) -> None:
        """A request of ``stage`` waited ``seconds`` from its submit to the start of its work
        (called from worker threads)."""
        with self.lock:
            self.stage_waits.append((stage, seconds))
            if len(self.stage_waits) > _KEEP:
                del self.stage_waits[: _KEEP // 2]

    def decode(self, stage: str, busy_s: float, audio_s: float) -> None:
        """A decoder step of ``stage`` took ``busy_s`` for ``audio_s`` of audio."""
        with self.lock:
            self.stage_decodes.append((stage, busy_s, audio_s))
            if len(self.stage_decodes) > _KEEP:
                del self.stage_decodes[: _KEEP // 2]

    def drain_waits(self) -> list[tuple[str, float]]:
        with self.lock:
            out, self.stage_waits = self.stage_waits, []
        return out

    def drain_decodes(self) -> list[tuple[str, float, float]]:
        with self.lock:
            out, self.stage_decodes = self.stage_decodes, []
        return out

    def drain_latencies(self) -> list[tuple[str, float]]:
        with self.lock:
            out, self.stage_latency = self.stage_latency, []
        return out

    def drain_steps(self) -> list[tuple[str, int]]:
        with self.lock:
            out, self.stage_steps = self.stage_steps, []
        return out
