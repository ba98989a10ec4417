"""The stage protocol, the two worker runtimes for model code, and replica pools.

A backend declares what it consumes and emits (``consumes``/``emits``, engine/edges.py)
and implements four calls::

    await backend.start()                      # load models; raises on failure
    async for out in backend.submit(request):  # stream outputs of one request
    await backend.abort(request_ids)           # stop those requests (their streams end)
    await backend.close()

``submit``/``abort`` are called on the orchestrator's event loop. Model compute never runs
there: :class:`ThreadedBackend` runs ``load``/``run`` in a worker thread and hands outputs
to the loop with ``call_soon_threadsafe``; :class:`BatchingBackend` runs one ``step`` over
many requests' pending items at a time (continuous batching across sessions). A request
whose work raises fails alone (:class:`StageError` ``stage_failed``); a worker thread that
dies fails the requests bound to it (``worker_died``) and is restarted.
"""

from __future__ import annotations

import asyncio
import functools
import heapq
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

from duplex_contract.errors import StageError
from engine import compute
from engine.edges import Edge
from engine.messages import StageDone, StageOutput, StageRequest
from engine.stage_figures import DecodeSource, QueueWaitSource, StepSource
from engine.tracing import EngineTracing

log = logging.getLogger(__name__)


@runtime_checkable
class StageBackend(Protocol):
    name: str
    consumes: Edge
    emits: Edge

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
    engine/edges.py) and, when they can use a GPU, ``device_kinds`` and
    ``cuda_device_count()``. ``device`` is this replica's resolved device (``cpu``,
    ``cuda:N``); ``stage`` is the configured stage name the replica belongs to.
    """

    Options: ClassVar[type[msgspec.Struct]]
    consumes: Edge
    emits: Edge
    device_kinds: ClassVar[frozenset[str]] = frozenset({"cpu"})
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
        try:
            with compute.working(self.name):
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


class BatchSlot:
    """One request inside the batching runtime, as a backend's ``step`` sees it.

    ``state`` is what ``prepare`` returned for the request. In a step, call ``emit`` for
    each output, ``finish()`` when the request has nothing more to produce, or
    ``fail(exc)`` to fail this request alone. Outputs of a step are delivered only after
    the step returns, so a step that raises emits nothing.
    """

    __slots__ = ("_failed", "_outputs", "done", "job", "request", "seq", "state", "steps")

    def __init__(self, job: _Job, seq: int, state: Any) -> None:
        self.job = job
        self.request = job.request
        self.seq = seq
        self.state = state
        self.steps = 0  # steps this request has taken part in
        self.done = False
        self._outputs: list[StageOutput] = []
        self._failed: Exception | None = None

    @property
    def cancelled(self) -> bool:
        return self.job.cancelled.is_set()

    def emit(self, out: StageOutput) -> None:
        self._outputs.append(out)

    def finish(self) -> None:
        self.done = True

    def fail(self, exc: Exception) -> None:
        self._failed = exc
        self.done = True

    def _reset(self) -> None:
        self._outputs = []
        self._failed = None
        self.done = False

    def _key(self) -> tuple[int, int]:
        return (int(self.request.priority), self.seq)


class BatchingBackend(WorkerBackend):
    """Continuous batching across sessions: one ``step`` advances many requests at once.

    Each step the worker takes what is ready from every request on this replica: new
    requests join between steps (``prepare`` runs for each as it joins), aborted requests
    leave before the next step (nothing of theirs is emitted after the abort), and when
    more than ``max_batch`` are ready the real-time ones are taken first (then by arrival).
    A request takes part in steps until it calls ``finish()``. One request's failure fails
    only that request: a step that raises is retried one request at a time to find it.
    ``step`` must therefore leave a request's state unchanged when it raises.

    ``max_batch`` comes from the backend's ``max_batch`` option (``default_max_batch``
    when it has none).
    """

    default_max_batch: ClassVar[int] = 8

    def __init__(
        self, options: Any, name: str, *, device: str = "cpu", stage: str | None = None
    ) -> None:
        super().__init__(options, name, device=device, stage=stage)
        self.max_batch = int(getattr(options, "max_batch", self.default_max_batch))
        self._cond = threading.Condition()
        self._pending: list[tuple[int, int, _Job]] = []
        self._seq = itertools.count()
        self._stop = False
        self._live: list[BatchSlot] = []
        # figures for metrics, tests and benchmarks (written by the worker thread)
        self.on_step: Callable[[int], None] | None = None  # step size -> metrics (the pool)
        self.steps = 0
        self.items_stepped = 0
        self.max_step_size = 0

    # -- to implement -----------------------------------------------------------------
    def prepare(self, request: StageRequest) -> Any:
        """Per-request state, made when the request joins (worker thread); raising fails
        that request alone."""
        return None

    @abstractmethod
    def step(self, batch: Sequence[BatchSlot]) -> None:
        """Advance every slot of ``batch`` by one step (worker thread)."""

    # -- runtime ----------------------------------------------------------------------
    def _enqueue(self, job: _Job) -> None:
        with self._cond:
            heapq.heappush(self._pending, (int(job.request.priority), next(self._seq), job))
            self._cond.notify()

    def _stop_worker(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()

    def _dead_jobs(self) -> list[_Job]:
        dead = [slot.job for slot in self._live]
        self._live = []
        return dead

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._live and not self._stop:
                    self._cond.wait()
                if self._stop:
                    joined = [job for _, _, job in self._pending]
                    self._pending.clear()
                    for job in [*joined, *(s.job for s in self._live)]:
                        _aborted(job)
                    self._live = []
                    return
                joined_seq = [(seq, job) for _, seq, job in self._pending]
                self._pending.clear()
            for seq, job in joined_seq:
                self._join(seq, job)
            for slot in [s for s in self._live if s.cancelled]:
                self._live.remove(slot)
                _aborted(slot.job)
            if not self._live:
                continue
            self._live.sort(key=BatchSlot._key)
            self._run_step(self._live[: self.max_batch])
            self._live = [s for s in self._live if not s.done]

    def _join(self, seq: int, job: _Job) -> None:
        if job.cancelled.is_set():
            _aborted(job)
            return
        try:
            state = self.prepare(job.request)
        except WorkerCrash:
            raise
        except Exception as exc:
            log.exception("stage %s failed request %s", self.name, job.request.request_id)
            job.deliver(StageError(f"{self.name}: {exc}", code="stage_failed"))
            job.deliver(_END)
            return
        self._live.append(BatchSlot(job, seq, state))

    def _run_step(self, batch: list[BatchSlot]) -> None:
        for slot in batch:
            slot._reset()
            if slot.steps == 0:  # its first step: its wait ends here
                self._waited(slot.job)
        try:
            with compute.working(self.name):
                self.step(batch)
        except WorkerCrash:
            raise
        except Exception as exc:
            if len(batch) == 1:
                batch[0].fail(exc)
            else:  # find the request that failed: one at a time, nothing emitted twice
                log.warning("stage %s: a batched step failed (%s); isolating", self.name, exc)
                for slot in batch:
                    slot._reset()
                    try:
                        self.step([slot])
                    except WorkerCrash:
                        raise
                    except Exception as one:
                        slot._reset()
                        slot.fail(one)
        self.steps += 1
        self.items_stepped += len(batch)
        self.max_step_size = max(self.max_step_size, len(batch))
        if self.on_step is not None:
            self.on_step(len(batch))
        for slot in batch:
            slot.steps += 1
            job = slot.job
            job.batch_max = max(job.batch_max, len(batch))
            if slot._failed is not None:
                log.error(
                    "stage %s failed request %s: %s",
                    self.name,
                    slot.request.request_id,
                    slot._failed,
                )
                job.deliver(StageError(f"{self.name}: {slot._failed}", code="stage_failed"))
                job.deliver(_END)
                continue
            if job.cancelled.is_set():  # aborted during the step: emit nothing of it
                slot.done = True
                _aborted(job)
                continue
            for out in slot._outputs:
                job.deliver(out)
            if slot.done:
                job.deliver(_END)


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
        replica = self.replicas[idx]
        span = None
        if self._tracing is not None:
            device = replica.device if isinstance(replica, WorkerBackend) else None
            span = self._tracing.start_stage(self.name, idx, device, request)
        try:
            async for out in replica.submit(request):
                if first and self._on_latency is not None:
                    self._on_latency(self.name, time.perf_counter() - started)
                first = False
                if span is not None:
                    span.output(out)
                    if isinstance(replica, WorkerBackend):
                        span.batch_size = max(
                            span.batch_size, replica.batch_size(request.request_id)
                        )
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
