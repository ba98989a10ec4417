"""Replica pools: N replicas of one stage, sessions sticky to one, batch work round-robin.

Health-aware: a replica that reports itself down (:class:`engine.stages.base.HealthSource`:
a dead vLLM EngineCore being restarted, a remote stage's open circuit) gets no new work
while another replica is up. A session sticky to it moves to the least loaded live one
(and stays there); batch work skips it. When every replica is down the work goes where it
would have gone, and fails there with that replica's own error."""

from __future__ import annotations

import asyncio
import functools
import itertools
import time
from collections.abc import AsyncIterator, Callable, Sequence

from engine.messages import StageOutput, StageRequest
from engine.spans import EngineTracing
from engine.stage_figures import DecodeSource, QueueWaitSource, StepSource
from engine.stages.base import BatchSizeSource, HealthSource, StageBackend


class StagePool:
    """N replicas of one stage. Sessions stick to one replica; batch requests round-robin."""

    def __init__(
        self,
        name: str,
        replicas: Sequence[StageBackend],
        on_latency: Callable[[str, float], None] | None = None,
        on_step: Callable[[str, int], None] | None = None,
        tracing: EngineTracing | None = None,
        on_wait: Callable[[str, float], None] | None = None,
        on_decode: Callable[[str, float, float], None] | None = None,
    ) -> None:
        if not replicas:
            raise ValueError("a stage pool needs at least one replica")
        self.name = name
        self.replicas = list(replicas)
        self._rr = itertools.count()
        self._sticky: dict[str, int] = {}
        self._owner: dict[str, int] = {}
        self._load = [0] * len(self.replicas)
        self._on_latency = on_latency
        self._tracing = tracing if tracing is not None and tracing.enabled else None
        for replica in self.replicas:  # optional figures (engine/stage_figures.py)
            if on_step is not None and isinstance(replica, StepSource):
                replica.on_step = functools.partial(on_step, name)
            if on_wait is not None and isinstance(replica, QueueWaitSource):
                replica.on_wait = functools.partial(on_wait, name)
            if on_decode is not None and isinstance(replica, DecodeSource):
                replica.on_decode = functools.partial(on_decode, name)

    async def start(self) -> None:
        await asyncio.gather(*(r.start() for r in self.replicas))

    def down(self, idx: int) -> str | None:
        """Why replica ``idx`` is down, or None."""
        replica = self.replicas[idx]
        return replica.health() if isinstance(replica, HealthSource) else None

    def live(self) -> list[int]:
        """The replicas that do not report themselves down."""
        return [i for i in range(len(self.replicas)) if not self.down(i)]

    def _pick(self, request: StageRequest) -> int:
        n = len(self.replicas)
        live = self.live() if n > 1 else [0]
        sid = request.session_id
        if sid is None:
            if not live:
                return next(self._rr) % n
            for _ in range(n):
                idx = next(self._rr) % n
                if idx in live:
                    return idx
            return live[0]
        stuck = self._sticky.get(sid)
        if stuck is not None and (stuck in live or not live):
            return stuck
        idx = min(live or range(n), key=lambda i: (self._load[i], i))
        self._sticky[sid] = idx
        return idx

    async def submit(self, request: StageRequest) -> AsyncIterator[StageOutput]:
        idx = self._pick(request)
        self._owner[request.request_id] = idx
        self._load[idx] += 1
        started = time.perf_counter()
        first = True
        replica = self.replicas[idx]
        span = None
        sizes = None  # (looked up once: the check costs more than an attribute read)
        if self._tracing is not None:
            span = self._tracing.start_stage(self.name, idx, replica.device, request)
            sizes = replica if isinstance(replica, BatchSizeSource) else None
        try:
            async for out in replica.submit(request):
                if first and self._on_latency is not None:
                    self._on_latency(self.name, time.perf_counter() - started)
                first = False
                if span is not None:
                    span.output(out)
                    if sizes is not None:
                        span.batch_size = max(span.batch_size, sizes.batch_size(request.request_id))
                yield out
        except BaseException as exc:
            # (no local keeps the error: its traceback holds this frame, a cycle that would
            # leave the caller's objects to the cyclic GC)
            if span is not None:
                span.end(exc)
                span = None
            raise
        finally:
            self._load[idx] -= 1
            self._owner.pop(request.request_id, None)
            if span is not None:
                span.end(None)

    async def abort(self, request_ids: Sequence[str]) -> None:
        await self.abort_located(self.locate(request_ids))

    def locate(self, request_ids: Sequence[str]) -> list[tuple[int, list[str]]]:
        """Which replica runs each of these requests, as of now."""
        by_replica: dict[int, list[str]] = {}
        for rid in request_ids:
            idx = self._owner.get(rid)
            if idx is not None:
                by_replica.setdefault(idx, []).append(rid)
        return sorted(by_replica.items())

    def locate_prefix(self, prefix: str) -> list[tuple[int, list[str]]]:
        """Running requests whose id starts with ``prefix`` (a fence key), by replica."""
        return self.locate([rid for rid in self._owner if rid.startswith(prefix)])

    async def abort_located(self, located: Sequence[tuple[int, list[str]]]) -> None:
        await asyncio.gather(*(self.replicas[i].abort(ids) for i, ids in located))

    def release_session(self, session_id: str) -> None:
        self._sticky.pop(session_id, None)

    def replica_of(self, session_id: str) -> int | None:
        return self._sticky.get(session_id)

    async def close(self) -> None:
        await asyncio.gather(*(r.close() for r in self.replicas), return_exceptions=True)
