"""A stage's request slots, and the scheduling settings checked against them at start-up
(before any model loads; the scheduler that uses both is engine/orchestration/scheduling.py);
what the pipeline asks of that scheduler (:class:`Slots`) and a request's priority."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractAsyncContextManager
from typing import Protocol

from duplex_contract.errors import ConfigError
from engine.config import SchedulingConfig
from engine.messages import Priority, StageRequest
from engine.stages.base import CapacitySource, StageBackend


def replica_capacity(replica: StageBackend) -> int:
    """Request slots of one replica: its ``capacity`` (engine/stages/base.py
    ``CapacitySource``: a batch size, vLLM's ``max_num_seqs``, a remote stage's
    ``pool_size``), else 1 (a worker that runs one request at a time)."""
    cap = replica.capacity if isinstance(replica, CapacitySource) else 1
    return cap if cap >= 1 else 1


def check_scheduling(config: SchedulingConfig, capacities: Mapping[str, int]) -> None:
    """Refuse what cannot work (before any model loads): under ``capacity``, a reserve that
    leaves no slot of a stage to anything but real-time work."""
    if config.policy != "capacity":
        return
    for name, cap in capacities.items():
        cap = config.capacity.get(name, cap)
        reserve = config.reserves.get(name, config.reserve)
        if reserve >= cap:
            field_ = (
                f"engine.scheduling.reserves.{name}"
                if name in config.reserves
                else "engine.scheduling.reserve"
            )
            raise ConfigError(
                f"{field_}: {reserve} slot(s) reserved for real-time work, but stage "
                f"{name!r} has {cap} (engine.scheduling.capacity.{name}, or what its backend "
                "declares): batch requests, guesses and drafts could never run there. Give "
                f"it a smaller reserve (engine.scheduling.reserves.{name}) or more slots"
            )


class SlotTicket(Protocol):
    """A request's place in a stage's load, told of each output the request yields
    (``work``: it carries tokens, frames, audio or text, not only the request's end)."""

    def output(self, work: bool) -> None: ...


class Slots(Protocol):
    """When a request may use a stage: the orchestrator's scheduler
    (engine/orchestration/scheduling.py) holds the request's place for the whole of it."""

    def slot(
        self, stage: str, request: StageRequest
    ) -> AbstractAsyncContextManager[SlotTicket]: ...

    def capacity_of(self, stage: str) -> int:
        """The requests ``stage`` runs at once (its slots)."""
        ...


#: The priority of the next stage request of a piece of work, asked for each one it makes:
#: a draft's requests are ``DRAFT`` until its turn adopts it, then ``REALTIME``
#: (engine/orchestration/drafts.py).
Urgency = Callable[[], Priority]


def urgency_of(priority: Priority | Urgency) -> Urgency:
    if isinstance(priority, Priority):
        return lambda: priority
    return priority
