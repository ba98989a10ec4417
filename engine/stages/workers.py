"""The worker thread under both model runtimes, and the jobs it serves.

``submit``/``abort`` are called on the orchestrator's event loop. Model compute never runs
there: a :class:`Worker` owns one thread that loads the model, serves jobs and releases the
model at close, and hands outputs back to the loop with ``call_soon_threadsafe``. How jobs are
ordered and run is the runtime's (a :class:`JobLoop`): one request at a time
(engine/stages/threaded.py) or one ``step`` over many (engine/stages/batching.py). A request
whose work raises fails alone (:class:`StageError` ``stage_failed``); a worker thread that
dies (:class:`WorkerCrash`) fails the requests bound to it (``worker_died``) and is restarted.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from duplex_contract.errors import StageError
from engine.messages import StageDone, StageOutput, StageRequest

log = logging.getLogger(__name__)


class WorkerCrash(BaseException):
    """Raised inside a worker to simulate (or signal) the death of the worker itself."""


_END = object()  # a job's stream is over


@dataclass(eq=False)
class Job:
    """One request on a worker: its outputs go to ``out`` on the submitting ``loop``.

    The worker thread calls ``deliver``/``end``/``fail``/``end_aborted``; ``cancelled`` is
    set by an abort (any thread)."""

    request: StageRequest
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue[Any]
    on_wait: Callable[[float], None] | None = None  # submit -> start of its work, seconds
    cancelled: threading.Event = field(default_factory=threading.Event)
    batch_max: int = 0  # the largest step (requests at once) this job took part in
    queued_at: float = field(default_factory=time.perf_counter)  # submit time

    def _put(self, item: object) -> None:
        try:
            self.loop.call_soon_threadsafe(self.out.put_nowait, item)
        except RuntimeError:  # loop closed during shutdown: nobody is listening any more
            self.cancelled.set()

    def deliver(self, out: StageOutput) -> None:
        """One output of the request."""
        self._put(out)

    def end(self) -> None:
        """The request's stream is over."""
        self._put(_END)

    def fail(self, error: StageError) -> None:
        """The request failed: its stream raises ``error``."""
        self._put(error)
        self._put(_END)

    def end_aborted(self) -> None:
        """The request was aborted: its stream ends with ``StageDone("aborted")``."""
        self._put(StageDone(request_id=self.request.request_id, finish_reason="aborted"))
        self._put(_END)

    def started(self) -> None:
        """Its work starts now: its queue wait ends (reported to ``on_wait``)."""
        hook = self.on_wait
        if hook is not None:
            hook(time.perf_counter() - self.queued_at)


class JobLoop(Protocol):
    """How a runtime orders and runs the jobs of its worker (the worker calls it)."""

    def enqueue(self, job: Job) -> None:
        """Take a new job (event loop thread)."""
        ...

    def serve(self) -> None:
        """Run jobs until stopped (worker thread); a WorkerCrash propagates."""
        ...

    def stop(self) -> None:
        """Make ``serve`` return (event loop thread, at close)."""
        ...

    def dead_jobs(self) -> list[Job]:
        """The jobs bound to a worker that just died, forgotten (worker thread)."""
        ...


class Loadable(Protocol):
    """The model's side of a worker's life (both run in the worker thread)."""

    def load(self) -> None: ...

    def unload(self) -> None: ...


class Worker:
    """One worker thread and the jobs on it: ``start`` spawns the thread, which loads
    ``model`` and then runs ``jobs.serve()`` until close (then unloads the model); a thread
    that dies is restarted. ``submit``/``abort``/``close`` run on the event loop."""

    def __init__(self, name: str, model: Loadable, jobs: JobLoop) -> None:
        self.name = name
        self._model = model
        self._job_loop = jobs
        self._jobs: dict[str, Job] = {}
        self._thread: threading.Thread | None = None
        self._serving = False  # its model is loaded and its job loop has not crashed
        self._closing = False
        self._restarts = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._restart_task: asyncio.Task[None] | None = None
        # submit -> start of the request's work, seconds (the pool wires it to /metrics)
        self.on_wait: Callable[[float], None] | None = None

    @property
    def restarts(self) -> int:
        """Times the thread died and was restarted."""
        return self._restarts

    @property
    def alive(self) -> bool:
        """The worker thread runs now and serves: its model loaded, its job loop not crashed
        (a thread that crashed is still alive while it hands its jobs back)."""
        return self._serving and self._thread is not None and self._thread.is_alive()

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self._spawn()

    async def _spawn(self) -> None:
        assert self._loop is not None
        ready = self._loop.create_future()
        self._thread = threading.Thread(
            target=self._main, name=f"stage-{self.name}", args=(ready,), daemon=True
        )
        self._thread.start()
        try:
            await ready
        except StageError:
            # the thread failed to load and is ending: a failed start leaves none running
            await asyncio.to_thread(self._thread.join, 5.0)
            raise

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
            self._model.load()
        except Exception as exc:
            log.exception("stage %s failed to load", self.name)
            self._signal_ready(ready, StageError(f"{self.name}: load failed: {exc}"))
            return
        self._serving = True
        self._signal_ready(ready, None)
        try:
            self._job_loop.serve()
        except WorkerCrash as exc:
            self._serving = False
            self._on_crash(exc)
            return
        self._serving = False
        try:
            self._model.unload()
        except Exception:
            log.exception("stage %s unload failed", self.name)

    def _on_crash(self, exc: BaseException) -> None:
        log.error("stage %s worker died (%s); restarting", self.name, exc)
        for job in self._job_loop.dead_jobs():
            job.fail(StageError(f"{self.name}: worker died: {exc}", code="worker_died"))
        if self._closing or self._loop is None:
            return
        self._restarts += 1
        loop = self._loop
        try:
            loop.call_soon_threadsafe(self._restart_on, loop)
        except RuntimeError:
            pass

    def _restart_on(self, loop: asyncio.AbstractEventLoop) -> None:
        self._restart_task = loop.create_task(self._spawn(), name=f"restart-{self.name}")

    async def submit(self, request: StageRequest) -> AsyncIterator[StageOutput]:
        if self._closing:
            raise StageError(f"{self.name}: closed", code="stage_failed")
        job = Job(
            request=request,
            loop=asyncio.get_running_loop(),
            out=asyncio.Queue(),
            on_wait=self.on_wait,
        )
        self._jobs[request.request_id] = job
        self._job_loop.enqueue(job)
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
        """The most requests a step has run together with ``request_id`` (itself included;
        0: unknown, or the request is gone)."""
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
        self._job_loop.stop()
        thread = self._thread
        if thread is not None:
            await asyncio.to_thread(thread.join, 10.0)
