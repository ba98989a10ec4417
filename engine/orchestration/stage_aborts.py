"""The stage aborts of a fence: its running stage requests are located at once (before the
tasks that made them unwind) and aborted in a task of their own; each session keeps the
plans not finished yet, so its clean-up can wait for them before its slot is freed."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any, Protocol

Located = list[tuple[int, list[str]]]  # (replica index, request ids) of one stage


class AbortablePool(Protocol):
    """What aborting needs of a stage pool (engine/stages/pool.py ``StagePool``)."""

    def locate_prefix(self, prefix: str) -> Located: ...

    async def abort_located(self, located: Sequence[tuple[int, list[str]]]) -> None: ...


AbortPlan = list[tuple[AbortablePool, Located]]


class StageAborts:
    """Aborts over ``pools`` (stage name -> pool; read at each abort, so pools started
    later count); ``spawn(coro, name)`` runs an abort as a task nobody awaits."""

    def __init__(
        self,
        pools: Mapping[str, AbortablePool],
        spawn: Callable[[Coroutine[Any, Any, Any], str], None],
    ) -> None:
        self._pools = pools
        self._spawn = spawn
        self._plans: dict[str, list[AbortPlan]] = {}

    def plan(self, prefix: str) -> AbortPlan:
        """The running stage requests under ``prefix``, located now (before tasks unwind)."""
        return [(pool, pool.locate_prefix(prefix)) for pool in self._pools.values()]

    @staticmethod
    async def run(plan: AbortPlan) -> None:
        """Abort what ``plan`` located, every stage at once."""
        await asyncio.gather(*(pool.abort_located(located) for pool, located in plan if located))

    async def abort_now(self, prefix: str) -> None:
        """Abort the stage requests under ``prefix`` and wait for it (a batch request's)."""
        await self.run(self.plan(prefix))

    def abort(self, sid: str, prefix: str) -> None:
        """Abort a fence's stage requests; until done, the plan stays with the session."""
        plan = self.plan(prefix)
        if not any(located for _, located in plan):
            return
        plans = self._plans.setdefault(sid, [])
        plans.append(plan)

        async def go() -> None:
            await self.run(plan)
            if plan in plans:
                plans.remove(plan)

        self._spawn(go(), f"abort:{prefix}")

    def pending(self, sid: str) -> list[AbortPlan]:
        """The session's plans not finished yet."""
        return list(self._plans.get(sid, ()))

    def forget(self, sid: str) -> None:
        """The session is cleaned up: its plans are no longer its."""
        self._plans.pop(sid, None)
