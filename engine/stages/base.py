"""The stage protocol, a threaded backend base for model code, and replica pools.

A backend implements four calls::

    await backend.start()                      # load models; raises on failure
    async for out in backend.submit(request):  # stream outputs of one request
    await backend.abort(request_ids)           # stop those requests (their streams end)
    await backend.close()

``submit``/``abort`` are called on the orchestrator's event loop. Model compute never runs
there: :class:`ThreadedBackend` runs ``load``/``run`` in a worker thread and hands outputs
to the loop with ``call_soon_threadsafe``. A request whose ``run`` raises fails alone
(:class:`StageError` ``stage_failed``); a worker thread that dies fails the requests bound to
it (``worker_died``) and is restarted.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

import msgspec

from engine.errors import StageError
from engine.messages import StageDone, StageOutput, StageRequest

log = logging.getLogger(__name__)


@runtime_checkable
class StageBackend(Protocol):
    name: str

    async def start(self) -> None: ...

    def submit(self, request: StageRequest) -> AsyncIterator[StageOutput]: ...

    async def abort(self, request_ids: Sequence[str]) -> None: ...

    async def close(self) -> None: ...


class WorkerCrash(BaseException):
    """Raised inside a worker to simulate (or signal) the death of the worker itself."""


_END = object()


@dataclass(eq=False)
class _Job:
    request: StageRequest
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue[Any]
    cancelled: threading.Event = field(default_factory=threading.Event)

    def deliver(self, item: object) -> None:
        try:
            self.loop.call_soon_threadsafe(self.out.put_nowait, item)
        except RuntimeError:  # loop closed during shutdown: nobody is listening any more
            self.cancelled.set()


class ThreadedBackend(ABC):
    """Runs model code in one worker thread with a priority queue (real-time first).

    Subclasses set ``Options`` (a msgspec struct) and implement ``load`` and ``run``; both
    run in the worker thread. ``run`` is a generator; it should check ``cancelled`` between
    outputs (the base also stops forwarding as soon as the request is aborted).
    """

    Options: ClassVar[type[msgspec.Struct]]
    name: str

    def __init__(self, options: Any, name: str) -> None:
        self.options = options
        self.name = name
        self._queue: queue.PriorityQueue[tuple[int, int, _Job | None]] = queue.PriorityQueue()
        self._seq = itertools.count()
        self._jobs: dict[str, _Job] = {}
        self._thread: threading.Thread | None = None
        self._closing = False
        self._restarts = 0
        self._ready: asyncio.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._restart_task: asyncio.Task[None] | None = None

    # -- to implement -----------------------------------------------------------------
    @abstractmethod
    def load(self) -> None:
        """Load models (worker thread)."""

    @abstractmethod
    def run(self, request: StageRequest, cancelled: threading.Event) -> Iterator[StageOutput]:
        """Produce the outputs of one request (worker thread)."""

    def unload(self) -> None:  # noqa: B027 - optional hook
        """Release models (worker thread, at close)."""

    # -- lifecycle --------------------------------------------------------------------
    @property
    def restarts(self) -> int:
        return self._restarts

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self._spawn()

    async def _spawn(self) -> None:
        assert self._loop is not None
        self._ready = self._loop.create_future()
        self._thread = threading.Thread(
            target=self._main, name=f"stage-{self.name}", args=(self._ready,), daemon=True
        )
        self._thread.start()
        await self._ready

    def _signal_ready(self, fut: asyncio.Future[None], exc: BaseException | None) -> None:
        assert self._loop is not None

        def settle() -> None:
            if fut.done():
                return
            if exc is None:
                fut.set_result(None)
            else:
                fut.set_exception(exc)

        try:
            self._loop.call_soon_threadsafe(settle)
        except RuntimeError:
            pass

    def _main(self, ready: asyncio.Future[None]) -> None:
        try:
            self.load()
        except Exception as exc:
            log.exception("stage %s failed to load", self.name)
            self._signal_ready(ready, StageError(f"{self.name}: load failed: {exc}"))
            return
        self._signal_ready(ready, None)
        job: _Job | None = None
        try:
            while True:
                _, _, job = self._queue.get()
                if job is None:
                    break
                self._process(job)
                job = None
        except WorkerCrash as exc:
            self._on_crash(job, exc)
            return
        try:
            self.unload()
        except Exception:
            log.exception("stage %s unload failed", self.name)

    def _process(self, job: _Job) -> None:
        request = job.request
        if job.cancelled.is_set():
            job.deliver(StageDone(request_id=request.request_id, finish_reason="aborted"))
            job.deliver(_END)
            return
        try:
            for out in self.run(request, job.cancelled):
                if job.cancelled.is_set():
                    break
                job.deliver(out)
        except WorkerCrash:
            raise
        except Exception as exc:
            log.exception("stage %s failed request %s", self.name, request.request_id)
            job.deliver(StageError(f"{self.name}: {exc}", code="stage_failed"))
            job.deliver(_END)
            return
        if job.cancelled.is_set():
            job.deliver(StageDone(request_id=request.request_id, finish_reason="aborted"))
        job.deliver(_END)

    def _on_crash(self, current: _Job | None, exc: BaseException) -> None:
        log.error("stage %s worker died (%s); restarting", self.name, exc)
        dead = [current] if current is not None else []
        for job in dead:
            job.deliver(StageError(f"{self.name}: worker died: {exc}", code="worker_died"))
            job.deliver(_END)
        if self._closing or self._loop is None:
            return
        self._restarts += 1
        loop = self._loop
        try:
            loop.call_soon_threadsafe(self._restart_on, loop)
        except RuntimeError:
            pass

    def _restart_on(self, loop: asyncio.AbstractEventLoop) -> None:
        task = loop.create_task(self._spawn(), name=f"restart-{self.name}")
        self._restart_task = task

    async def submit(self, request: StageRequest) -> AsyncIterator[StageOutput]:
        if self._closing:
            raise StageError(f"{self.name}: closed", code="stage_failed")
        job = _Job(request=request, loop=asyncio.get_running_loop(), out=asyncio.Queue())
        self._jobs[request.request_id] = job
        self._queue.put((int(request.priority), next(self._seq), job))
        try:
            while True:
                item = await job.out.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                if job.cancelled.is_set() and not isinstance(item, StageDone):
                    continue  # aborted: never forward another chunk
                yield item
        finally:
            job.cancelled.set()
            self._jobs.pop(request.request_id, None)

    async def abort(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            job = self._jobs.get(rid)
            if job is not None:
                job.cancelled.set()

    async def close(self) -> None:
        self._closing = True
        for job in list(self._jobs.values()):
            job.cancelled.set()
        self._queue.put((-1, -1, None))
        thread = self._thread
        if thread is not None:
            await asyncio.to_thread(thread.join, 10.0)


class StagePool:
    """N replicas of one stage. Sessions stick to one replica; batch requests round-robin."""

    def __init__(
        self,
        name: str,
        replicas: Sequence[StageBackend],
        on_latency: Callable[[str, float], None] | None = None,
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

    async def start(self) -> None:
        await asyncio.gather(*(r.start() for r in self.replicas))

    def _pick(self, request: StageRequest) -> int:
        sid = request.session_id
        if sid is None:
            return next(self._rr) % len(self.replicas)
        idx = self._sticky.get(sid)
        if idx is None:
            idx = min(range(len(self.replicas)), key=lambda i: (self._load[i], i))
            self._sticky[sid] = idx
        return idx

    async def submit(self, request: StageRequest) -> AsyncIterator[StageOutput]:
        idx = self._pick(request)
        self._owner[request.request_id] = idx
        self._load[idx] += 1
        started = time.perf_counter()
        first = True
        try:
            async for out in self.replicas[idx].submit(request):
                if first and self._on_latency is not None:
                    self._on_latency(self.name, time.perf_counter() - started)
                first = False
                yield out
        finally:
            self._load[idx] -= 1
            self._owner.pop(request.request_id, None)

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
