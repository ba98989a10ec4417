"""Scheduling policy: when batch requests, speculative transcripts and draft responses may
use the stages beside real-time turns (``engine.scheduling`` in the config; docs/engine.md,
"Scheduling").

The orchestrator and the pipeline keep the mechanism (stage queues ordered by priority:
real-time, then drafts, then guesses, then batch; aborts; drafts held until adopted); the
policy decides. Every stage request the pipeline submits goes through
:meth:`Scheduler.slot`, which counts each stage's live load (requests in flight: queued or
running) by kind, and lets the policy hold batch requests back.

Two policies:

* ``serial`` (the CPU default, ``configs/cpu.yaml``; :class:`SerialScheduler` here): the
  stages share two cores, so any extra work delays a turn. Batch jobs run one at a time (a
  job's chained stage requests share its slot), and none of their stage requests starts
  while a session waits for its first audio
  (:class:`engine.orchestration.admission.BatchAdmission`); a pause is guessed (and answered
  ahead) only while no other session's real turn runs, and a real turn drops every other
  session's draft.
* ``capacity`` (GPU stages that batch; engine/orchestration/capacity.py): by each stage's
  capacity, live load and real-time budget.

Both bound a batch request's wait to start (``batch_wait_s``: past it, ``server_busy``).
Both count, per stage, the outputs of each kind of work; a draft's are held under its
request prefix until the draft book says whether its turn adopted it (``draft_used``) or
it was thrown away (``draft_wasted``): :meth:`Scheduler.figures` for ``/metrics``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

from duplex_contract.errors import StageError
from engine.config import SchedulingConfig
from engine.duplex.fencing import is_draft_request
from engine.messages import Priority, StageRequest
from engine.orchestration.admission import BatchAdmission, batch_job
from engine.orchestration.stage_loads import Kind, Loads, StageLoad, WorkTally
from engine.stage_figures import Pace, PaceSource, SchedulingFigures
from engine.stages.base import StageBackend


def request_kind(request: StageRequest) -> Kind:
    """What a stage request is for: a real turn, a draft answer (``Priority.DRAFT``, or any
    request under a draft's prefix), a guess, or batch work. (A draft its turn adopted does
    real-time work: :meth:`Scheduler.slot` counts its requests so.)"""
    p = request.priority
    if p == Priority.BATCH:
        return "batch"
    if p == Priority.SPECULATIVE:
        return "speculative"
    if p == Priority.DRAFT or is_draft_request(request.request_id):
        return "draft"
    return "realtime"


def draft_of(request_id: str) -> str:
    """The draft prefix of a draft's stage request (``sess_x/e3/draft7`` of
    ``sess_x/e3/draft7/llm``)."""
    return "/".join(request_id.split("/", 3)[:3])


class Ticket:
    """A request's place in a stage's load; the pipeline calls ``output(work)`` per output
    (``work``: it carries tokens, frames, audio or text, not only the request's end)."""

    __slots__ = ("_count", "_first", "_on_first", "_stage", "kind")

    def __init__(
        self,
        stage: StageLoad,
        kind: Kind,
        on_first: Callable[[], None],
        count: Callable[[], None],
    ) -> None:
        self._stage = stage
        self.kind = kind
        self._first = kind == "realtime"
        self._on_first = on_first
        self._count = count

    def output(self, work: bool = True) -> None:
        if work:
            self._count()
        if self._first:
            self._first = False
            self._stage.realtime_waiting -= 1
            self._on_first()

    def end(self) -> None:
        if self._first:
            self._first = False
            self._stage.realtime_waiting -= 1
            self._on_first()


class Scheduler:
    """Load bookkeeping shared by both policies, and the policy's decisions.

    Create and use on the orchestrator's loop. ``turn_running(besides)`` tells whether a
    real turn runs in a session other than ``besides`` (the serial rules need it);
    ``paces`` gives a stage's pace (its slowest replica's, engine/stage_figures.py) and
    ``shared`` the stages on the same GPU as each (:func:`shared_gpus`);
    ``yield_drafts(stage, n)`` is called (soon, not inside a submit) when ``n`` draft
    requests should leave ``stage`` for a real-time request. ``loads`` holds every stage's
    load and budget, ``tally`` the work each kind of request got (the draft book tells it
    how each draft ended), both engine/orchestration/stage_loads.py.
    """

    policy: str = "base"

    def __init__(
        self,
        config: SchedulingConfig,
        capacities: Mapping[str, int],
        turn_running: Callable[[str], bool],
        paces: Mapping[str, Callable[[], Pace | None]] | None = None,
        shared: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        self.config = config
        self.loads = Loads(config, capacities, paces or {}, shared)
        self.stages = self.loads.stages
        self.tally = WorkTally(self.stages)
        self._turn_running = turn_running
        self.yield_drafts: Callable[[str, int], None] | None = None

    # ---------------------------------------------------------------- mechanism
    @asynccontextmanager
    async def slot(self, stage: str, request: StageRequest) -> AsyncIterator[Ticket]:
        """Hold ``request``'s place in ``stage`` for the whole of the request."""
        rid = request.request_id
        kind = request_kind(request)
        draft: str | None = draft_of(rid) if kind == "draft" else None
        if draft is not None and self.tally.adopted(draft):
            kind, draft = "realtime", None  # an adopted draft's: its turn's real-time work
        st = self.stages[stage]
        async with self._admit(stage, st, kind, rid):
            st.load += 1
            st.by_kind[kind] += 1
            st.requests[rid] = kind
            if kind == "realtime":
                st.realtime_waiting += 1
                self._pressure(stage, st)
            # (an adopted draft's later requests are real-time work the draft made)
            use = "draft_used" if kind == "realtime" and is_draft_request(rid) else kind
            ticket = Ticket(st, kind, self._changed, self.tally.counter(stage, use, draft))
            try:
                yield ticket
            finally:
                ticket.end()
                st.load -= 1
                st.by_kind[kind] -= 1
                st.requests.pop(rid, None)
                self._changed()

    def capacity_of(self, stage: str) -> int:
        """The requests ``stage`` runs at once (its slots)."""
        return self.stages[stage].capacity

    def draft_requests(self, stage: str) -> list[str]:
        """Request ids of the drafts in flight in ``stage``."""
        return [r for r, k in self.stages[stage].requests.items() if k == "draft"]

    def snapshot(self) -> dict[str, dict[str, int]]:
        """Capacity and load per stage (tests, logs)."""
        return self.loads.snapshot()

    def figures(self) -> dict[str, SchedulingFigures]:
        """Every stage's state for ``/metrics``."""
        return self.loads.figures()

    # ---------------------------------------------------------------- policy hooks
    @asynccontextmanager
    async def _admit(
        self, stage: str, st: StageLoad, kind: Kind, request_id: str
    ) -> AsyncIterator[None]:
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


def busy_error(config: SchedulingConfig, stage: str, st: StageLoad) -> StageError:
    """A batch request waited ``batch_wait_s`` and did not start (counted in ``st``)."""
    st.batch_timeouts += 1
    return StageError(
        f"stage {stage!r} is busy with real-time work: a batch request waited "
        f"{config.batch_wait_s:g} s to start (engine.scheduling.batch_wait_s); try again later",
        code="server_busy",
    )


class SerialScheduler(Scheduler):
    """Today's CPU rules (see the module docstring)."""

    policy = "serial"

    def __init__(
        self,
        config: SchedulingConfig,
        capacities: Mapping[str, int],
        turn_running: Callable[[str], bool],
        paces: Mapping[str, Callable[[], Pace | None]] | None = None,
        shared: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        super().__init__(config, capacities, turn_running, paces, shared)
        self.admission = BatchAdmission()

    @asynccontextmanager
    async def _admit(
        self, stage: str, st: StageLoad, kind: Kind, request_id: str
    ) -> AsyncIterator[None]:
        if kind != "batch":
            yield
            return
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        held = self.admission.slot(Priority.BATCH, batch_job(request_id))
        st.batch_waiting += 1
        try:
            async with asyncio.timeout(self.config.batch_wait_s):
                await held.__aenter__()
        except TimeoutError:
            raise busy_error(self.config, stage, st) from None
        finally:
            st.batch_waiting -= 1
        waited = loop.time() - t0
        if waited > 0.001:
            st.batch_waits += 1
        st.waited(waited)
        try:
            yield
        finally:
            await held.__aexit__(None, None, None)

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


def stage_paces(pools: Mapping[str, Any]) -> dict[str, Callable[[], Pace | None]]:
    """Per stage whose replicas report a pace: the slowest replica's (``pools``: name ->
    StagePool)."""
    out: dict[str, Callable[[], Pace | None]] = {}
    for name, pool in pools.items():
        sources = [r for r in pool.replicas if isinstance(r, PaceSource)]
        if sources:
            out[name] = _slowest(sources)
    return out


def shared_gpus(pools: Mapping[str, Any]) -> dict[str, list[str]]:
    """Per stage, the stages with a replica on one of its GPUs (``cuda:N``), itself first
    (``pools``: name -> StagePool)."""
    gpus = {
        name: {
            r.device
            for r in pool.replicas
            if isinstance(r, StageBackend) and r.device.startswith("cuda")
        }
        for name, pool in pools.items()
    }
    return {
        name: [name, *(o for o in gpus if o != name and gpus[o] & mine)]
        for name, mine in gpus.items()
    }


def _slowest(sources: list[PaceSource]) -> Callable[[], Pace | None]:
    def pace() -> Pace | None:
        paces = [p for p in (s.pace() for s in sources) if p is not None]
        return min(paces, key=lambda p: p.ratio) if paces else None

    return pace


__all__ = [
    "Scheduler",
    "SerialScheduler",
    "Ticket",
    "busy_error",
    "draft_of",
    "request_kind",
    "shared_gpus",
    "stage_paces",
]
