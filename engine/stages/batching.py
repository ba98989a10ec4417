"""The batching runtime: continuous batching across sessions, one ``step`` at a time."""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

from duplex_contract.errors import StageError
from engine.messages import StageOutput, StageRequest
from engine.orchestration import compute
from engine.stages.workers import _END, WorkerBackend, WorkerCrash, _aborted, _Job

log = logging.getLogger(__name__)


@runtime_checkable
class BatchOptions(Protocol):
    """Options with a ``max_batch``: requests one step takes at most."""

    @property
    def max_batch(self) -> int: ...


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
        self.max_batch = (
            int(options.max_batch) if isinstance(options, BatchOptions) else self.default_max_batch
        )
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

    @property
    def capacity(self) -> int:
        """Request slots (engine/orchestration/scheduling.py): requests one step takes at most."""
        return self.max_batch

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
