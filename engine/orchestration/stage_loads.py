"""What the scheduling policy knows of each stage (engine/orchestration/scheduling.py): its
slots, live load by kind, real-time budget (:class:`Loads`), and the work each kind of
request got out of it (:class:`WorkTally`).

* Slots and the budget: a stage's *capacity* is its request slots (replicas x ``max_batch``,
  vLLM's ``max_num_seqs``, a remote stage's ``pool_size``, 1 for a one-at-a-time worker, or
  ``engine.scheduling.capacity``); its *limit* is fewer where its cost model says fewer
  streams keep real time (``Pace.limit``, engine/stage_figures.py). A stage that reports
  its pace (the talker: tokens per second per live stream against the 82 its audio needs)
  is *behind* while that ratio is under ``realtime_margin``, and so is every stage placed on
  the same GPU (their calls and steps take turns on it: the other stages' work is what slows
  the talker down). *Spare* room: load + reserve is under the limit, it is not behind, and
  (``hold_for_first_output``, the default) no real-time request waits there for its first
  output.
* The work tally: every output a stage gives (a token, a frame, an audio chunk, a
  transcript) is counted by its use: ``realtime``, ``speculative``, ``batch``, and a
  draft's, held under the draft's request prefix until the draft book says whether its turn
  adopted it (``draft_used``) or it was thrown away (``draft_wasted``).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from engine.config import SchedulingConfig
from engine.stage_figures import WAIT_BOUNDS, Pace, SchedulingFigures

Kind = Literal["realtime", "draft", "speculative", "batch"]
KINDS: tuple[Kind, ...] = ("realtime", "draft", "speculative", "batch")
USES = ("realtime", "draft_used", "draft_wasted", "speculative", "batch")
_KEEP_DRAFTS = 4096  # draft prefixes remembered (live tallies and outcomes)


@dataclass
class StageLoad:
    """One stage's capacity, live load (requests submitted and not yet ended) and figures."""

    capacity: int
    reserve: int = 0
    load: int = 0
    by_kind: dict[Kind, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    #: real-time requests (not drafts) that have not produced their first output yet
    realtime_waiting: int = 0
    #: request id -> kind, of the requests in flight (drafts are looked up here)
    requests: dict[str, Kind] = field(default_factory=dict)
    batch_waiting: int = 0
    batch_waits: int = 0
    batch_aged: int = 0
    batch_timeouts: int = 0
    drafts_yielded: int = 0
    wait_buckets: list[int] = field(default_factory=lambda: [0] * (len(WAIT_BOUNDS) + 1))
    wait_sum_s: float = 0.0
    outputs: dict[str, int] = field(default_factory=lambda: dict.fromkeys(USES, 0))

    def waited(self, seconds: float) -> None:
        """A batch request waited ``seconds`` to be admitted (0: it was not held)."""
        self.wait_buckets[bisect.bisect_left(WAIT_BOUNDS, seconds)] += 1
        self.wait_sum_s += seconds


class Loads:
    """Every stage's :class:`StageLoad`, pace, limit and spare room (module docstring)."""

    def __init__(
        self,
        config: SchedulingConfig,
        capacities: Mapping[str, int],
        paces: Mapping[str, Callable[[], Pace | None]],
        shared: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        self.config = config
        #: stage -> the stages whose GPU it shares (itself included)
        self._shared = dict(shared or {})
        self.stages = {
            name: StageLoad(
                capacity=config.capacity.get(name, cap),
                reserve=config.reserves.get(name, config.reserve),
            )
            for name, cap in capacities.items()
        }
        self._paces = dict(paces)

    def pace(self, stage: str) -> Pace | None:
        get = self._paces.get(stage)
        return get() if get is not None else None

    def limit(self, stage: str) -> int:
        cap = self.stages[stage].capacity
        pace = self.pace(stage)
        return max(1, min(cap, pace.limit)) if pace is not None and pace.limit else cap

    def behind(self, stage: str) -> bool:
        """Its live streams, or those of a stage on the same GPU (whose time they share),
        get less than ``realtime_margin`` x what real time needs."""
        margin = self.config.realtime_margin
        for name in self._shared.get(stage, (stage,)):
            pace = self.pace(name)
            if pace is not None and pace.streams > 0 and pace.ratio < margin:
                return True
        return False

    def spare(self, stage: str, paced: bool = True) -> bool:
        st = self.stages[stage]
        if st.realtime_waiting and self.config.hold_for_first_output:
            return False
        return st.load + st.reserve < self.limit(stage) and not (paced and self.behind(stage))

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

    def figures(self) -> dict[str, SchedulingFigures]:
        """Every stage's state for ``/metrics``."""
        out = {}
        for name, st in self.stages.items():
            pace = self.pace(name)
            out[name] = SchedulingFigures(
                capacity=st.capacity,
                limit=self.limit(name),
                reserve=st.reserve,
                in_flight={str(k): v for k, v in st.by_kind.items()},
                realtime_waiting=st.realtime_waiting,
                batch_waiting=st.batch_waiting,
                pace=round(min(pace.ratio, 1000.0), 3) if pace is not None else 0.0,
                batch_waits=st.batch_waits,
                batch_aged=st.batch_aged,
                batch_timeouts=st.batch_timeouts,
                drafts_yielded=st.drafts_yielded,
                wait_buckets=tuple(st.wait_buckets),
                wait_sum_s=st.wait_sum_s,
                outputs=dict(st.outputs),
            )
        return out


class WorkTally:
    """Counts each stage's outputs by use (module docstring)."""

    def __init__(self, stages: Mapping[str, StageLoad]) -> None:
        self._stages = stages
        #: live drafts' outputs per stage, until the draft book says how each ended
        self._tally: dict[str, dict[str, int]] = {}
        self._used: dict[str, bool] = {}  # ended drafts: adopted?

    def adopted(self, prefix: str) -> bool:
        return self._used.get(prefix, False)

    def counter(self, stage: str, use: str, draft: str | None) -> Callable[[], None]:
        """The function that counts one output of a request of ``stage`` (``draft``: the
        draft prefix of a draft's request; ``use``: else, what it is for)."""
        outputs = self._stages[stage].outputs
        if draft is None:

            def count() -> None:
                outputs[use] += 1

            return count

        def count_draft() -> None:
            tally = self._tally.get(draft)
            if tally is not None:
                tally[stage] = tally.get(stage, 0) + 1
            elif draft in self._used:
                outputs["draft_used" if self._used[draft] else "draft_wasted"] += 1
            else:  # a draft the book has not announced: tally until it says
                self._tally[draft] = {stage: 1}
                self._trim()

        return count_draft

    def started(self, prefix: str) -> None:
        """The draft ``prefix`` started: its outputs are tallied."""
        self._tally.setdefault(prefix, {})
        self._trim()

    def ended(self, prefix: str, used: bool) -> None:
        """... and it was adopted by its turn (``used``) or thrown away."""
        use = "draft_used" if used else "draft_wasted"
        for stage, n in self._tally.pop(prefix, {}).items():
            self._stages[stage].outputs[use] += n
        self._used[prefix] = used
        self._trim()

    def _trim(self) -> None:
        while len(self._tally) > _KEEP_DRAFTS:  # never announced as ended: wasted
            self.ended(next(iter(self._tally)), False)
        while len(self._used) > _KEEP_DRAFTS:
            del self._used[next(iter(self._used))]


__all__ = ["KINDS", "USES", "Kind", "Loads", "StageLoad", "WorkTally"]
