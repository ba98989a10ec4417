"""The ``capacity`` scheduling policy (engine/orchestration/scheduling.py has the mechanism):
work beside real-time turns by each stage's slots, live load and real-time budget.

* **Slots and the budget.** A stage's capacity is its request slots (replicas x
  ``max_batch``, vLLM's ``max_num_seqs``, a remote stage's ``pool_size``, 1 for a
  one-at-a-time worker, or ``scheduling.capacity``); its *limit* is fewer where its cost
  model says fewer streams keep real time (``Pace.limit``). A stage that reports its pace
  (engine/stage_figures.py: the talker's tokens per second per live stream against the 82
  its audio needs) is *behind* while that ratio is under ``realtime_margin``: slots then
  count for nothing, since on a device that several stages share (one GPU) the other
  stages' work slows the talker down however many slots it has free.
* **What may start beside real-time work.** A stage has *spare* room while no real-time
  request waits there for its first output, its load + its reserve is under its limit,
  and it is not behind. Guesses need spare room on the input stages, drafts on the
  responder and output stages.
* **Batch work** is admitted by job (``batch_concurrency`` jobs at once; a job's chained
  stage requests, talker -> codec, share its place, so batch speech streams), on spare
  room. A batch request that waited ``batch_age_s`` starts as soon as its stage has a free
  slot and runs no other batch request (the minimum share: batch work always finishes);
  one that waited ``batch_wait_s`` fails with ``server_busy`` (HTTP 503).
* **Drafts yield.** Drafts run below every real-time request in the stage queues
  (``Priority.DRAFT``). When a real-time request enters a stage that is over its limit, or
  behind, drafts holding that stage are dropped (newest first: as many as it is over, at
  least one when behind); other sessions' turns alone drop nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager

from engine.config import SchedulingConfig
from engine.orchestration.admission import batch_job
from engine.orchestration.scheduling import Scheduler, busy_error
from engine.orchestration.stage_loads import Kind, Loads, StageLoad
from engine.stage_figures import Pace

#: how often a waiting batch request looks again without an event (a stage's pace changes
#: with time, not with requests coming and going)
POLL_S = 0.25


class CapacityAdmission:
    """Batch admission by job over the stages' :class:`Loads` (the module docstring's
    "Batch work"); and the sessions inside their time-to-first-audio window (figures
    only: this policy does not hold batch work back for them)."""

    def __init__(self, config: SchedulingConfig, loads: Loads) -> None:
        self.config = config
        self.loads = loads
        self._waiters: list[asyncio.Future[None]] = []
        #: batch jobs admitted -> their stage requests in flight
        self.jobs: dict[str, int] = {}
        self.waits = 0  # batch stage requests that had to wait for room
        self._critical: set[str] = set()

    @property
    def critical(self) -> int:
        return len(self._critical)

    def enter_critical(self, key: str) -> None:
        self._critical.add(key)

    def leave_critical(self, key: str) -> None:
        self._critical.discard(key)

    def may_start(self, stage: str, job: str) -> bool:
        loads = self.loads
        if job in self.jobs:  # the job holds a place: its next stage needs a free slot
            return loads.stages[stage].load < loads.limit(stage)
        return len(self.jobs) < self.config.batch_concurrency and loads.spare(stage)

    def aged(self, stage: str, st: StageLoad, waited: float) -> bool:
        """The minimum share: waited long enough, the stage runs no batch request and has a
        free slot."""
        return (
            waited >= self.config.batch_age_s
            and st.by_kind["batch"] == 0
            and st.load < self.loads.limit(stage)
        )

    @asynccontextmanager
    async def slot(self, stage: str, request_id: str) -> AsyncIterator[None]:
        """Hold a batch stage request's admission for the whole of it."""
        st = self.loads.stages[stage]
        job = batch_job(request_id)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        if not self.may_start(stage, job):
            self.waits += 1
            st.batch_waits += 1
            st.batch_waiting += 1
            try:
                await self._wait(stage, st, job, t0)
            finally:
                st.batch_waiting -= 1
        st.waited(loop.time() - t0)
        self.jobs[job] = self.jobs.get(job, 0) + 1
        try:
            yield
        finally:
            self.jobs[job] -= 1
            if not self.jobs[job]:
                del self.jobs[job]
            self.changed()

    async def _wait(self, stage: str, st: StageLoad, job: str, t0: float) -> None:
        loop = asyncio.get_running_loop()
        bound = self.config.batch_wait_s
        while True:
            waited = loop.time() - t0
            if self.may_start(stage, job):
                return
            if self.aged(stage, st, waited):
                st.batch_aged += 1
                return
            if waited >= bound:
                raise busy_error(self.config, stage, st)
            fut = loop.create_future()
            self._waiters.append(fut)
            try:
                await asyncio.wait({fut}, timeout=min(POLL_S, bound - waited))
            finally:
                if fut in self._waiters:
                    self._waiters.remove(fut)

    def changed(self) -> None:
        """Wake the waiting batch requests to look again (a request left a stage, or a
        real-time request got its first output)."""
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)


class CapacityScheduler(Scheduler):
    """Work beside real-time turns by each stage's free capacity (module docstring)."""

    policy = "capacity"

    def __init__(
        self,
        config: SchedulingConfig,
        capacities: Mapping[str, int],
        turn_running: Callable[[str], bool],
        paces: Mapping[str, Callable[[], Pace | None]] | None = None,
        shared: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        super().__init__(config, capacities, turn_running, paces, shared)
        self.admission = CapacityAdmission(config, self.loads)

    @property
    def waits(self) -> int:
        """Batch stage requests that had to wait for room."""
        return self.admission.waits

    def enter_critical(self, key: str) -> None:
        self.admission.enter_critical(key)

    def leave_critical(self, key: str) -> None:
        self.admission.leave_critical(key)

    @asynccontextmanager
    async def _admit(
        self, stage: str, st: StageLoad, kind: Kind, request_id: str
    ) -> AsyncIterator[None]:
        if kind != "batch":
            yield
            return
        async with self.admission.slot(stage, request_id):
            yield

    def _changed(self) -> None:
        self.admission.changed()

    def _pressure(self, stage: str, st: StageLoad) -> None:
        drafts = st.by_kind["draft"]
        if not drafts or self.yield_drafts is None:
            return
        n = min(drafts, st.load - self.loads.limit(stage))
        if n > 0:
            st.drafts_yielded += n
            asyncio.get_running_loop().call_soon(self.yield_drafts, stage, n)

    def may_guess(self, session_id: str, stages: Iterable[str]) -> bool:
        return all(self.loads.spare(s, paced=False) for s in stages)

    def may_draft(self, session_id: str, stages: Iterable[str]) -> bool:
        return all(self.loads.spare(s, paced=False) for s in stages)

    def turn_drops_drafts(self) -> bool:
        return False


__all__ = ["POLL_S", "CapacityAdmission", "CapacityScheduler"]
