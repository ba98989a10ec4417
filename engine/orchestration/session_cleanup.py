"""A closing session's clean-up: everything it runs is stopped (its draft, its turn, its
stage requests), and only once every stage abort has finished is its slot freed and the
control plane told (``finish_close``). A clean-up that times out or fails is retried by the
reaper (the control plane's ``tick`` hands the session out again)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, Protocol

from engine.duplex.fencing import session_prefix
from engine.orchestration.draft_book import DraftBook
from engine.orchestration.live_partials import LivePartials
from engine.orchestration.speculation import SpeculativeAsr
from engine.orchestration.stage_aborts import StageAborts
from engine.orchestration.turn_runner import TurnRunner
from engine.spans import EngineTracing

log = logging.getLogger(__name__)


class StickyPool(Protocol):
    """What a clean-up needs of a stage pool (engine/stages/pool.py ``StagePool``)."""

    def release_session(self, session_id: str) -> None: ...


class SessionCleanup:
    """Cleans closing sessions up, each once at a time. ``finish(sid)``: tell the control
    plane the session is gone and carry out what that starts; ``spawn(coro, name)`` runs
    a clean-up as a task nobody awaits."""

    def __init__(
        self,
        timeout_s: float,
        drafts: DraftBook,
        aborts: StageAborts,
        turns: TurnRunner,
        speculation: SpeculativeAsr,
        pools: Mapping[str, StickyPool],
        tracing: EngineTracing,
        partials: LivePartials | None,
        *,
        finish: Callable[[str], None],
        spawn: Callable[[Coroutine[Any, Any, Any], str], None],
    ) -> None:
        self._timeout_s = timeout_s
        self._drafts = drafts
        self._aborts = aborts
        self._turns = turns
        self._speculation = speculation
        self._pools = pools
        self._tracing = tracing
        self._partials = partials
        self._finish = finish
        self._spawn = spawn
        self._cleaning: set[str] = set()

    @property
    def cleaning(self) -> set[str]:
        """The sessions whose clean-up runs now (the reaper does not hand them out)."""
        return self._cleaning

    def start(self, sid: str) -> None:
        """Clean ``sid`` up in a task, unless that runs already."""
        if sid not in self._cleaning:
            self._cleaning.add(sid)
            self._spawn(self._cleanup(sid), f"cleanup:{sid}")

    async def _cleanup(self, sid: str) -> None:
        """Abort everything of a closing session; free its slot only once that succeeded."""
        try:
            self._drafts.drop(sid)
            self._aborts.abort(sid, session_prefix(sid))
            await self._turns.stop(sid)
            plans = self._aborts.pending(sid)
            try:
                await asyncio.wait_for(
                    asyncio.gather(*(self._aborts.run(p) for p in plans)), self._timeout_s
                )
            except TimeoutError:
                log.warning("cleanup of %s: stage aborts did not finish; the reaper retries", sid)
                return
            self._aborts.forget(sid)
            self._speculation.drop(sid)
            for pool in self._pools.values():
                pool.release_session(sid)
            self._tracing.session_closed(sid)
            if self._partials is not None:
                self._partials.drop(sid)
            self._finish(sid)
        except Exception:
            log.exception("cleanup of %s failed; the reaper retries it", sid)
        finally:
            self._cleaning.discard(sid)
