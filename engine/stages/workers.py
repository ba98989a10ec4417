"""The worker runtimes' shared lifecycle, and the one-request-at-a-time runtime.

``submit``/``abort`` are called on the orchestrator's event loop. Model compute never runs
there: :class:`ThreadedBackend` runs ``load``/``run`` in a worker thread and hands outputs
to the loop with ``call_soon_threadsafe``; :class:`engine.stages.batching.BatchingBackend`
(the other runtime, on the same :class:`WorkerBackend` lifecycle) runs one ``step`` over
many requests' pending items at a time. A request whose work raises fails alone
(:class:`StageError` ``stage_failed``); a worker thread that dies fails the requests bound
to it (``worker_died``) and is restarted.
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
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgspec

from duplex_contract.errors import StageError
from engine.messages import StageDone, StageOutput, StageRequest, TtsRequest
from engine.orchestration import compute
from engine.orchestration.edges import Edge

log = logging.getLogger(__name__)


class WorkerCrash(BaseException):
    """Raised inside a worker to simulate (or signal) the death of the worker itself."""


_END = object()


@dataclass(eq=False)
class _Job:
    request: StageRequest
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue[Any]
    cancelled: threading.Event = field(default_factory=threading.Event)
    batch_max: int = 0  # the largest step (requests at once) this job took part in
    queued_at: float = field(default_factory=time.perf_counter)  # submit time

    def deliver(self, item: object) -> None:
        try:
            self.loop.call_soon_threadsafe(self.out.put_nowait, item)
        except RuntimeError:  # loop closed during shutdown: nobody is listening any more
            self.cancelled.set()


class WorkerBackend(ABC):
    """Shared lifecycle of the two worker runtimes: a worker thread that loads the model,
    serves jobs, and is restarted when it dies; ``submit``/``abort``/``close`` on the loop.

    Subclasses declare ``Options`` (a msgspec struct), ``consumes``/``emits`` (edge types,
    engine/orchestration/edges.py) and, when they can use a GPU, ``device_kinds`` and
    ``cuda_device_count()``. ``device`` is this replica's resolved device (``cpu``,
    ``cuda:N``); ``stage`` is the configured stage name the replica belongs to. With
    those it implements :class:`engine.stages.base.StageBackend` (and
    ``BatchSizeSource``, ``QueueWaitSource``).
    """

    Options: ClassVar[type[msgspec.Struct]]
    consumes: Edge
    emits: Edge
    device_kinds: ClassVar[frozenset[str]] = frozenset({"cpu"})
    keeps_auto: ClassVar[bool] = False
    name: str

    def __init__(
        self, options: Any, name: str, *, device: str = "cpu", stage: str | None = None
    ) -> None:
        self.options = options
        self.name = name
        self.device = device
        self.stage = stage or name
        self._jobs: dict[str, _Job] = {}
        self._thread: threading.Thread | None = None
        self._closing = False
        self._restarts = 0
        self._ready: asyncio.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._restart_task: asyncio.Task[None] | None = None
        # submit -> start of the request's work, seconds (the pool wires it to /metrics)
        self.on_wait: Callable[[float], None] | None = None

    def _waited(self, job: _Job) -> None:
        """``job``'s work starts now (worker thread)."""
        hook = self.on_wait
        if hook is not None:
            hook(time.perf_counter() - job.queued_at)

    @classmethod
    def cuda_device_count(cls) -> int:
        """CUDA devices this backend can use on this machine (0: CPU only)."""
        return 0

    # -- to implement -----------------------------------------------------------------
    @abstractmethod
    def load(self) -> None:
        """Load models (worker thread)."""

    def unload(self) -> None:  # noqa: B027 - optional hook
        """Release models (worker thread, at close)."""

    @abstractmethod
    def _enqueue(self, job: _Job) -> None:
        """Hand a new job to the worker (loop thread)."""

    @abstractmethod
    def _serve(self) -> None:
        """The worker's job loop; returns when closing; WorkerCrash propagates (worker)."""

    @abstractmethod
    def _stop_worker(self) -> None:
        """Make ``_serve`` return (loop thread, at close)."""

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
        try:
            self._serve()
        except WorkerCrash as exc:
            self._on_crash(exc)
            return
        try:
            self.unload()
        except Exception:
            log.exception("stage %s unload failed", self.name)

    def _dead_jobs(self) -> list[_Job]:
        """Jobs bound to the worker that just died (worker thread)."""
        return []

    def _on_crash(self, exc: BaseException) -> None:
        log.error("stage %s worker died (%s); restarting", self.name, exc)
        for job in self._dead_jobs():
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
        self._enqueue(job)
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

    def batch_size(self, request_id: str) -> int:
        """The most requests a step of this replica has run together with ``request_id``
        (itself included; 0: unknown, or the request is gone)."""
        job = self._jobs.get(request_id)
        return 0 if job is None else job.batch_max

    async def abort(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            job = self._jobs.get(rid)
            if job is not None:
                job.cancelled.set()

    async def close(self) -> None:
        self._closing = True
        for job in list(self._jobs.values()):
            job.cancelled.set()
        self._stop_worker()
        thread = self._thread
        if thread is not None:
            await asyncio.to_thread(thread.join, 10.0)


def _aborted(job: _Job) -> None:
    job.deliver(StageDone(request_id=job.request.request_id, finish_reason="aborted"))
    job.deliver(_END)


class ThreadedBackend(WorkerBackend):
    """Runs model code one request at a time in a worker thread (real-time first).

    Subclasses implement ``load`` and ``run``; both run in the worker thread. ``run`` is a
    generator; it should check ``cancelled`` between outputs (the base also stops
    forwarding as soon as the request is aborted).
    """

    def __init__(
        self, options: Any, name: str, *, device: str = "cpu", stage: str | None = None
    ) -> None:
        super().__init__(options, name, device=device, stage=stage)
        self._queue: queue.PriorityQueue[tuple[int, int, _Job | None]] = queue.PriorityQueue()
        self._seq = itertools.count()
        self._current: _Job | None = None

    @abstractmethod
    def run(self, request: StageRequest, cancelled: threading.Event) -> Iterator[StageOutput]:
        """Produce the outputs of one request (worker thread)."""

    def _enqueue(self, job: _Job) -> None:
        self._queue.put((int(job.request.priority), next(self._seq), job))

    def _stop_worker(self) -> None:
        self._queue.put((-1, -1, None))

    def _dead_jobs(self) -> list[_Job]:
        return [self._current] if self._current is not None else []

    def _serve(self) -> None:
        while True:
            _, _, job = self._queue.get()
            if job is None:
                return
            self._current = job
            self._process(job)
            self._current = None

    def _process(self, job: _Job) -> None:
        request = job.request
        if job.cancelled.is_set():
            _aborted(job)
            return
        job.batch_max = 1  # one request at a time
        self._waited(job)
        first = isinstance(request, TtsRequest) and request.first
        try:
            with (
                compute.working(self.name),
                compute.urgent(compute.group_of(request.request_id)) if first else nullcontext(),
            ):
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
