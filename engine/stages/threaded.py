"""The one-request-at-a-time runtime: a worker thread runs each request's ``run`` in turn.

A backend whose library takes one input at a time (llama.cpp, piper, espeak, pocketsphinx)
implements :class:`RequestModel` (``load``, ``run``, ``unload``, all in the worker thread)
and holds a :class:`ThreadedRuntime`, which owns the thread (engine/stages/workers.py), the
queue (real-time requests before batch ones, then by arrival), aborts, and the compute marks
of engine/stages/compute.py: every request is marked ``working`` while it runs, and
a response's first clause in speech (``TtsRequest.first``) also ``urgent`` under its
response's group.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections.abc import Iterator
from contextlib import nullcontext
from typing import Protocol

from duplex_contract.errors import StageError
from engine.messages import StageDone, StageOutput, StageRequest, TtsRequest
from engine.stages import compute
from engine.stages.stage_front import StageFront
from engine.stages.workers import Job, Worker, WorkerCrash

log = logging.getLogger(__name__)


class RequestModel(Protocol):
    """What a one-request-at-a-time backend implements (every call in the worker thread)."""

    def load(self) -> None:
        """Load the model."""
        ...

    def run(self, request: StageRequest, cancelled: threading.Event) -> Iterator[StageOutput]:
        """The outputs of one request; check ``cancelled`` between outputs (the runtime
        also stops forwarding them as soon as the request is aborted)."""
        ...

    def unload(self) -> None:
        """Release the model (at close)."""
        ...


class ThreadedRuntime(StageFront):
    """Runs ``model`` one request at a time in a worker thread (real-time first).

    The stage interface a backend forwards to it: ``start``, ``submit``, ``abort``,
    ``close``, ``restarts``, ``batch_size`` and the ``on_wait`` hook. ``enqueue``, ``serve``,
    ``stop`` and ``dead_jobs`` are its worker's (:class:`engine.stages.workers.JobLoop`).
    """

    def __init__(self, name: str, model: RequestModel) -> None:
        self.name = name
        self._model = model
        self._queue: queue.PriorityQueue[tuple[int, int, Job | None]] = queue.PriorityQueue()
        self._seq = itertools.count()
        self._current: Job | None = None
        self.worker = Worker(name, model, self)

    def serving(self) -> Worker:
        return self.worker

    # -- the stage interface ------------------------------------------------------------

    # -- the worker's job loop ----------------------------------------------------------
    def enqueue(self, job: Job) -> None:
        self._queue.put((int(job.request.priority), next(self._seq), job))

    @property
    def waiting(self) -> bool:
        """Another request waits for the one running now (worker thread: its model may
        cut background work short for it)."""
        return not self._queue.empty()

    def stop(self) -> None:
        self._queue.put((-1, -1, None))

    def dead_jobs(self) -> list[Job]:
        return [self._current] if self._current is not None else []

    def serve(self) -> None:
        while True:
            _, _, job = self._queue.get()
            if job is None:
                return
            self._current = job
            self._process(job)
            self._current = None

    def _process(self, job: Job) -> None:
        request = job.request
        if job.cancelled.is_set():
            job.end_aborted()
            return
        job.batch_max = 1  # one request at a time
        job.started()
        first = isinstance(request, TtsRequest) and request.first
        try:
            with (
                compute.working(self.name),
                compute.urgent(compute.group_of(request.request_id)) if first else nullcontext(),
            ):
                after = 0  # items the model gave since the abort
                for out in self._model.run(request, job.cancelled):
                    if job.cancelled.is_set():
                        # the model's own end says what it read (an LLM's prompt tokens:
                        # usage); one that stops within a token gives it next, else stop
                        if isinstance(out, StageDone):
                            job.deliver(out)
                            job.end()
                            return
                        after += 1
                        if after > 2:
                            break
                        continue
                    job.deliver(out)
        except WorkerCrash:
            raise
        except Exception as exc:
            log.exception("stage %s failed request %s", self.name, request.request_id)
            job.fail(StageError(f"{self.name}: {exc}", code="stage_failed"))
            return
        if job.cancelled.is_set():
            job.end_aborted()
        else:
            job.end()
