"""The batching runtime: continuous batching across sessions, one ``step`` at a time.

A backend that can advance many requests in one call (Whisper's batched encoder and decoder,
the SNAC decoder, a forward pass on a GPU) implements :class:`BatchModel` (``load``,
``prepare``, ``step``, ``unload``, all in the worker thread) and holds a
:class:`BatchingRuntime`, which owns the worker thread (engine/stages/workers.py), the
requests waiting and running, aborts, priorities, the compute mark of each step
(engine/stages/compute.py) and the step figures. ``gather_s``: an idle runtime waits
that long after a request arrives for others to join its first step (fewer, fuller steps).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from duplex_contract.errors import StageError
from engine.messages import StageOutput, StageRequest
from engine.stages import compute
from engine.stages.stage_front import StageFront
from engine.stages.workers import Job, Worker, WorkerCrash

log = logging.getLogger(__name__)


class BatchSlot:
    """One request inside the batching runtime, as a backend's ``step`` sees it.

    ``state`` is what ``prepare`` returned for the request. In a step, call ``emit`` for
    each output, ``finish()`` when the request has nothing more to produce, or
    ``fail(exc)`` to fail this request alone. Outputs of a step are delivered only after
    the step returns, so a step that raises emits nothing. ``clear``, ``outputs`` and
    ``failure`` are the runtime's.
    """

    __slots__ = ("_failure", "_outputs", "done", "job", "request", "seq", "state", "steps")

    def __init__(self, job: Job, seq: int, state: Any) -> None:
        self.job = job
        self.request = job.request
        self.seq = seq  # arrival order
        self.state = state
        self.steps = 0  # steps this request has taken part in
        self.done = False
        self._outputs: list[StageOutput] = []
        self._failure: Exception | None = None

    @property
    def cancelled(self) -> bool:
        return self.job.cancelled.is_set()

    def emit(self, out: StageOutput) -> None:
        self._outputs.append(out)

    def finish(self) -> None:
        self.done = True

    def fail(self, exc: Exception) -> None:
        self._failure = exc
        self.done = True

    def clear(self) -> None:
        """Forget what a step emitted, finished or failed (before a step, or its retry)."""
        self._outputs = []
        self._failure = None
        self.done = False

    @property
    def outputs(self) -> list[StageOutput]:
        """What the last step emitted for this request."""
        return self._outputs

    @property
    def failure(self) -> Exception | None:
        """Why the last step failed this request, or None."""
        return self._failure


class BatchModel(Protocol):
    """What a batching backend implements (every call in the worker thread)."""

    def load(self) -> None:
        """Load the model."""
        ...

    def prepare(self, request: StageRequest) -> Any:
        """Per-request state, made when the request joins; raising fails that request."""
        ...

    def step(self, batch: Sequence[BatchSlot]) -> None:
        """Advance every slot of ``batch`` by one step; leave a request's state unchanged
        when it raises (the step is then retried one request at a time)."""
        ...

    def unload(self) -> None:
        """Release the model (at close)."""
        ...


def _order(slot: BatchSlot) -> tuple[int, int]:
    return (int(slot.request.priority), slot.seq)


class BatchingRuntime(StageFront):
    """Continuous batching across sessions: one ``step`` advances many requests at once.

    Each step the worker takes what is ready from every request on this replica: new
    requests join between steps (``prepare`` runs for each as it joins), aborted requests
    leave before the next step (nothing of theirs is emitted after the abort), and when
    more than ``max_batch`` are ready the real-time ones are taken first (then by arrival).
    A request takes part in steps until it calls ``finish()``. One request's failure fails
    only that request: a step that raises is retried one request at a time to find it.

    The stage interface a backend forwards to it: ``start``, ``submit``, ``abort``,
    ``close``, ``restarts``, ``batch_size``, ``capacity`` and the ``on_wait``/``on_step``
    hooks; ``steps``, ``items_stepped`` and ``max_step_size`` are its figures (tests,
    benchmarks). ``enqueue``, ``serve``, ``stop`` and ``dead_jobs`` are its worker's.
    """

    def __init__(
        self, name: str, model: BatchModel, max_batch: int, *, gather_s: float = 0.0
    ) -> None:
        self.name = name
        self._model = model
        self.max_batch = max_batch  # requests one step takes at most
        #: an idle runtime waits this long after a request arrives for others to join it
        self.gather_s = gather_s
        self._cond = threading.Condition()
        self._pending: list[tuple[int, int, Job]] = []
        self._seq = itertools.count()
        self._stop = False
        self._live: list[BatchSlot] = []
        # figures for metrics, tests and benchmarks (written by the worker thread)
        self.on_step: Callable[[int], None] | None = None  # step size -> metrics (the pool)
        self.steps = 0
        self.items_stepped = 0
        self.max_step_size = 0
        self.worker = Worker(name, model, self)

    def serving(self) -> Worker:
        return self.worker

    # -- the stage interface ------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Request slots (engine/orchestration/scheduling.py): requests one step takes at most."""
        return self.max_batch

    def running(self) -> list[StageRequest]:
        """The requests taking part in steps now (a snapshot; tests)."""
        return [slot.request for slot in list(self._live)]

    # -- the worker's job loop ----------------------------------------------------------
    def enqueue(self, job: Job) -> None:
        with self._cond:
            heapq.heappush(self._pending, (int(job.request.priority), next(self._seq), job))
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()

    def dead_jobs(self) -> list[Job]:
        dead = [slot.job for slot in self._live]
        self._live = []
        return dead

    def serve(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._live and not self._stop:
                    self._cond.wait()
                if self.gather_s > 0 and not self._live:
                    deadline = time.monotonic() + self.gather_s
                    while len(self._pending) < self.max_batch and not self._stop:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            break
                        self._cond.wait(left)
                if self._stop:
                    joined = [job for _, _, job in self._pending]
                    self._pending.clear()
                    for job in [*joined, *(s.job for s in self._live)]:
                        job.end_aborted()
                    self._live = []
                    return
                joined_seq = [(seq, job) for _, seq, job in self._pending]
                self._pending.clear()
            for seq, job in joined_seq:
                self._join(seq, job)
            for slot in [s for s in self._live if s.cancelled]:
                self._live.remove(slot)
                slot.job.end_aborted()
            if not self._live:
                continue
            self._live.sort(key=_order)
            self._run_step(self._live[: self.max_batch])
            self._live = [s for s in self._live if not s.done]

    def _join(self, seq: int, job: Job) -> None:
        if job.cancelled.is_set():
            job.end_aborted()
            return
        try:
            state = self._model.prepare(job.request)
        except WorkerCrash:
            raise
        except Exception as exc:
            log.exception("stage %s failed request %s", self.name, job.request.request_id)
            job.fail(StageError(f"{self.name}: {exc}", code="stage_failed"))
            return
        self._live.append(BatchSlot(job, seq, state))

    def _run_step(self, batch: list[BatchSlot]) -> None:
        for slot in batch:
            slot.clear()
            if slot.steps == 0:  # its first step: its wait ends here
                slot.job.started()
        try:
            with compute.working(self.name):
                self._model.step(batch)
        except WorkerCrash:
            raise
        except Exception as exc:
            if len(batch) == 1:
                batch[0].fail(exc)
            else:  # find the request that failed: one at a time, nothing emitted twice
                log.warning("stage %s: a batched step failed (%s); isolating", self.name, exc)
                self._isolate(batch)
        self.steps += 1
        self.items_stepped += len(batch)
        self.max_step_size = max(self.max_step_size, len(batch))
        if self.on_step is not None:
            self.on_step(len(batch))
        for slot in batch:
            self._settle(slot, len(batch))

    def _isolate(self, batch: list[BatchSlot]) -> None:
        """Step each slot of a failed batch alone: only the one that raises fails."""
        for slot in batch:
            slot.clear()
            try:
                self._model.step([slot])
            except WorkerCrash:
                raise
            except Exception as one:
                slot.clear()
                slot.fail(one)

    def _settle(self, slot: BatchSlot, size: int) -> None:
        """Deliver what a step did for ``slot`` (a step of ``size`` requests)."""
        slot.steps += 1
        job = slot.job
        job.batch_max = max(job.batch_max, size)
        failure = slot.failure
        if failure is not None:
            log.error("stage %s failed request %s: %s", self.name, slot.request.request_id, failure)
            job.fail(StageError(f"{self.name}: {failure}", code="stage_failed"))
            return
        if job.cancelled.is_set():  # aborted during the step: emit nothing of it
            slot.done = True
            job.end_aborted()
            return
        for out in slot.outputs:
            job.deliver(out)
        if slot.done:
            job.end()
