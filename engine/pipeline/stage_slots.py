"""A stage's request slots, and the scheduling settings checked against them at start-up
(before any model loads; the scheduler that uses both is engine/orchestration/scheduling.py)."""

from __future__ import annotations

from collections.abc import Mapping

from duplex_contract.errors import ConfigError
from engine.config import SchedulingConfig
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
