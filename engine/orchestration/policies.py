"""The scheduling policy a config names, built over the running stage pools
(engine/orchestration/scheduling.py: ``serial``; engine/orchestration/capacity.py:
``capacity``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from engine.config import SchedulingConfig
from engine.orchestration.capacity import CapacityScheduler
from engine.orchestration.scheduling import (
    Scheduler,
    SerialScheduler,
    shared_gpus,
    stage_paces,
)
from engine.pipeline.stage_slots import check_scheduling, replica_capacity


def make_scheduler(
    config: SchedulingConfig,
    pools: Mapping[str, Any],
    turn_running: Callable[[str], bool],
) -> Scheduler:
    """The policy named in ``engine.scheduling``, over ``pools`` (name -> StagePool)."""
    capacities = {
        name: sum(replica_capacity(r) for r in pool.replicas) for name, pool in pools.items()
    }
    check_scheduling(config, capacities)
    cls = CapacityScheduler if config.policy == "capacity" else SerialScheduler
    return cls(config, capacities, turn_running, stage_paces(pools), shared_gpus(pools))


__all__ = ["make_scheduler"]
