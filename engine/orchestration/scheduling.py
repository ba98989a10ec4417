"""Scheduling policy: when batch requests, speculative transcripts and draft responses may
use the stages beside real-time turns (``engine.scheduling`` in the config; docs/engine.md,
"Scheduling").

The orchestrator and the pipeline keep the mechanism (stage queues ordered real-time first,
aborts, drafts held until adopted); this module decides. Every stage request the pipeline
submits goes through :meth:`Scheduler.slot`, which counts each stage's live load (requests
in flight: queued or running) by kind, and lets the policy hold batch requests back.

Two policies:

* ``serial`` (the CPU default, ``configs/cpu.yaml``): the stages share two cores, so any
  extra work delays a turn. Batch jobs run one at a time (a job's chained stage requests
  share its slot), and none of their stage requests starts while a session waits for its
  first audio (:class:`engine.orchestration.admission.BatchAdmission`); a pause is guessed (and
  answered ahead) only while no other session's real turn runs, and a real turn drops
  every other session's draft.
* ``capacity`` (GPU stages that batch): each stage has a capacity (request slots: replicas x
  ``max_batch``, vLLM's ``max_num_seqs``, 1 for a one-at-a-time worker, or
  ``scheduling.capacity``) and a live load. Batch stage requests, guesses and drafts start
  while every stage they need has a free slot beyond ``reserve`` and no real-time request
  waits there for its first output; batch stage requests also wait for a free one of
  ``batch_concurrency``. When a real-time request enters a stage that is full, drafts
  holding that stage are dropped (newest first, as many as it is over), so a draft never
  delays a real turn; other sessions' turns alone drop nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

from engine.config import SchedulingConfig
from engine.duplex.fencing import is_draft_request
from engine.messages import Priority, StageRequest
from engine.orchestration.admission import BatchAdmission, batch_job
from engine.stages.base import CapacitySource, StageBackend

Kind = Literal["realtime", "draft", "speculative", "batch"]


def request_kind(request: StageRequest) -> Kind:
    """What a stage request is for: a real turn, a draft answer, a guess, or batch work."""
    if request.priority == Priority.BATCH:
        return "batch"
    if request.priority == Priority.SPECULATIVE:
        return "speculative"
    return "draft" if is_draft_request(request.request_id) else "realtime"


def replica_capacity(replica: StageBackend) -> int:
    """Request slots of one replica: its ``capacity`` (engine/stages/base.py
    ``CapacitySource``: a batch size, vLLM's ``max_num_seqs``), else 1 (a worker that runs
    one request at a time)."""
    cap = replica.capacity if isinstance(replica, CapacitySource) else 1
    return cap if cap >= 1 else 1


@dataclass
class StageLoad:
    """One stage's capacity and live load (requests submitted and not yet ended)."""

    capacity: int
    load: int = 0
    by_kind: dict[Kind, int] = field(
        default_factory=lambda: {"realtime": 0, "draft": 0, "speculative": 0, "batch": 0}
    )
    #: real-time requests (not drafts) that have not produced their first output yet
    realtime_waiting: int = 0
    #: request id -> kind, of the requests in flight (drafts are looked up here)
    requests: dict[str, Kind] = field(default_factory=dict)


class Ticket:
    """A request's place in a stage's load; the pipeline calls ``output()`` per output."""

    __slots__ = ("_first", "_on_first", "_stage", "kind")

    def __init__(self, stage: StageLoad, kind: Kind, on_first: Callable[[], None]) -> None:
        self._stage = stage
        self.kind = kind
        self._first = kind == "realtime"
        self._on_first = on_first

    def output(self) -> None:
        if self._first:
            self._first = False
            self._stage.realtime_waiting -= 1
            self._on_first()

    def end(self) -> None:
        self.output()


class Scheduler:
    """Load bookkeeping shared by both policies, and the policy's decisions.

    Create and use on the orchestrator's loop. ``turn_running(besides)`` tells whether a
    real turn runs in a session other than ``besides`` (the serial rules need it);
    ``yield_drafts(stage, n)`` is called (soon, not inside a submit) when ``n`` draft
    requests should leave ``stage`` for a real-time request.
    """

    policy: str = "base"

    def __init__(
        self,
        config: SchedulingConfig,
        capacities: Mapping[str, int],
        turn_running: Callable[[str], bool],
    ) -> None:
        self.config = config
        self.stages = {
            name: StageLoad(capacity=config.capacity.get(name, cap))
            for name, cap in capacities.items()
        }
        self._turn_running = turn_running
        self.yield_drafts: Callable[[str, int], None] | None = None

    # ---------------------------------------------------------------- mechanism
    @asynccontextmanager
    async def slot(self, stage: str, request: StageRequest) -> AsyncIterator[Ticket]:
        """Hold ``request``'s place in ``stage`` for the whole of the request."""
        kind = request_kind(request)
        async with self._admit(stage, kind, request.request_id):
            st = self.stages[stage]
            st.load += 1
            st.by_kind[kind] += 1
            st.requests[request.request_id] = kind
            if kind == "realtime":
                st.realtime_waiting += 1
                self._pressure(stage, st)
            ticket = Ticket(st, kind, self._changed)
            try:
                yield ticket
            finally:
                ticket.end()
                st.load -= 1
                st.by_kind[kind] -= 1
                st.requests.pop(request.request_id, None)
                self._changed()

    def draft_requests(self, stage: str) -> list[str]:
        """Request ids of the drafts in flight in ``stage``."""
        return [r for r, k in self.stages[stage].requests.items() if k == "draft"]

    def snapshot(self) -> dict[str, dict[str, int]]:
        """Capacity and load per stage (tests, logs)."""
        return {
            name: {
                "capacity": st.capacity,
                "load": st.load,
                "realtime_waiting": st.realtime_waiting,
                **{str(k): v for k, v in st.by_kind.items()},
            }
            for name, st in self.stages.items()
        }

    # ---------------------------------------------------------------- policy hooks
    @asynccontextmanager
    async def _admit(self, stage: str, kind: Kind, request_id: str) -> AsyncIterator[None]:
        yield

    def _pressure(self, stage: str, st: StageLoad) -> None:
        """A real-time request entered ``stage`` (already counted in its load)."""

    def _changed(self) -> None:
        """A request left a stage."""

    def enter_critical(self, key: str) -> None:
        """A session's turn began waiting for its first output."""

    def leave_critical(self, key: str) -> None:
        """... and got it (or ended)."""

    def may_guess(self, session_id: str, stages: Iterable[str]) -> bool:
        """May a pause of ``session_id`` be transcribed ahead on ``stages``?"""
        raise NotImplementedError

    def may_draft(self, session_id: str, stages: Iterable[str]) -> bool:
        """May ``session_id``'s pause be answered ahead on ``stages``?"""
        raise NotImplementedError

    def turn_drops_drafts(self) -> bool:
        """Does a real turn that starts drop every other session's draft?"""
        raise NotImplementedError


class SerialScheduler(Scheduler):
    """Today's CPU rules (see the module docstring)."""

    policy = "serial"

    def __init__(
        self,
        config: SchedulingConfig,
        capacities: Mapping[str, int],
        turn_running: Callable[[str], bool],
    ) -> None:
        super().__init__(config, capacities, turn_running)
        self.admission = BatchAdmission()

    @asynccontextmanager
    async def _admit(self, stage: str, kind: Kind, request_id: str) -> AsyncIterator[None]:
        priority = Priority.BATCH if kind == "batch" else Priority.REALTIME
        async with self.admission.slot(priority, batch_job(request_id)):
            yield

    def enter_critical(self, key: str) -> None:
        self.admission.enter_critical(key)

    def leave_critical(self, key: str) -> None:
        self.admission.leave_critical(key)

    def may_guess(self, session_id: str, stages: Iterable[str]) -> bool:
        return not self._turn_running(session_id)

    def may_draft(self, session_id: str, stages: Iterable[str]) -> bool:
        return not self._turn_running(session_id)

    def turn_drops_drafts(self) -> bool:
        return True


class CapacityScheduler(Scheduler):
    """Work beside real-time turns by each stage's free capacity (module docstring)."""

    policy = "capacity"

    def __init__(
        self,
        config: SchedulingConfig,
        capacities: Mapping[str, int],
        turn_running: Callable[[str], bool],
    ) -> None:
        super().__init__(config, capacities, turn_running)
        self._waiters: list[asyncio.Future[None]] = []
        self.batch_running = 0
        self.waits = 0  # batch stage requests that had to wait for capacity
        self._critical: set[str] = set()

    @property
    def critical(self) -> int:
        return len(self._critical)

    def enter_critical(self, key: str) -> None:
        self._critical.add(key)

    def leave_critical(self, key: str) -> None:
        self._critical.discard(key)

    def spare(self, stage: str) -> bool:
        """``stage`` has a free slot beyond the reserve and no real-time request waits."""
        st = self.stages[stage]
        return st.realtime_waiting == 0 and st.load + self.config.reserve < st.capacity

    def _batch_may_start(self, stage: str) -> bool:
        return self.batch_running < self.config.batch_concurrency and self.spare(stage)

    @asynccontextmanager
    async def _admit(self, stage: str, kind: Kind, request_id: str) -> AsyncIterator[None]:
        if kind != "batch":
            yield
            return
        if not self._batch_may_start(stage):
            self.waits += 1
            while not self._batch_may_start(stage):
                fut = asyncio.get_running_loop().create_future()
                self._waiters.append(fut)
                try:
                    await fut
                finally:
                    if fut in self._waiters:
                        self._waiters.remove(fut)
        self.batch_running += 1
        try:
            yield
        finally:
            self.batch_running -= 1
            self._changed()

    def _changed(self) -> None:
        """Wake the waiting batch requests to look again (a request left a stage)."""
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    def _pressure(self, stage: str, st: StageLoad) -> None:
        over = st.load - st.capacity
        drafts = st.by_kind["draft"]
        if over > 0 and drafts > 0 and self.yield_drafts is not None:
            asyncio.get_running_loop().call_soon(self.yield_drafts, stage, min(over, drafts))

    def may_guess(self, session_id: str, stages: Iterable[str]) -> bool:
        return all(self.spare(s) for s in stages)

    def may_draft(self, session_id: str, stages: Iterable[str]) -> bool:
        return all(self.spare(s) for s in stages)

    def turn_drops_drafts(self) -> bool:
        return False


def make_scheduler(
    config: SchedulingConfig,
    pools: Mapping[str, Any],
    turn_running: Callable[[str], bool],
) -> Scheduler:
    """The policy named in ``engine.scheduling``, over ``pools`` (name -> StagePool)."""
    capacities = {
        name: sum(replica_capacity(r) for r in pool.replicas) for name, pool in pools.items()
    }
    cls = CapacityScheduler if config.policy == "capacity" else SerialScheduler
    return cls(config, capacities, turn_running)


def stage_names(stages: Sequence[Any]) -> list[str]:
    return [s.name for s in stages]


__all__ = [
    "CapacityScheduler",
    "Scheduler",
    "SerialScheduler",
    "StageLoad",
    "Ticket",
    "make_scheduler",
    "replica_capacity",
    "request_kind",
]
