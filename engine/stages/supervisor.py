"""Health and bounded restart of a stage replica whose engine runs in another process.

A :class:`Supervisor` polls ``probe`` (why the engine is dead, or None) every
``interval_s`` on the replica's own loop. When the engine is found dead:

1. ``health()`` names the cause at once (``/health`` turns 503 naming the stage);
2. ``fail_requests(reason)`` fails every request in flight with that reason (the replica's
   sessions get an error for their current turn and go on);
3. after ``backoff_s`` (doubling per consecutive failed attempt, up to 30 s) ``restart()``
   brings up a new engine; ``restarts`` counts every attempt (``/metrics``:
   ``duplex_stage_restarts_total``). A restart that fails is retried until ``max_restarts``
   attempts have been made in all; then the replica stays down and ``health()`` says so.

A restart that succeeds makes the replica healthy again. The supervisor knows nothing of
vLLM: the vLLM stages' engine gives it its probe and restart (engine/stages/vllm_engine.py),
and its logic is tested with fakes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

_MAX_BACKOFF_S = 30.0


class Supervisor:
    def __init__(
        self,
        name: str,
        *,
        probe: Callable[[], str | None],
        fail_requests: Callable[[str], None],
        restart: Callable[[], Awaitable[None]],
        max_restarts: int,
        interval_s: float = 0.5,
        backoff_s: float = 1.0,
    ) -> None:
        self.name = name
        self._probe = probe
        self._fail = fail_requests
        self._restart = restart
        self.max_restarts = max_restarts
        self.interval_s = interval_s
        self.backoff_s = backoff_s
        self.restarts = 0  # restart attempts, successful or not
        self.down: str | None = None  # why the replica is down now (None: healthy)
        self.gave_up = False

    def health(self) -> str | None:
        return self.down

    def suspect(self, why: str) -> None:
        """A request saw the engine die (any thread): report it down now, before the next
        probe confirms it and restarts."""
        if self.down is None:
            self.down = f"{self.name}: {why}; restarting"

    async def run(self) -> None:
        """Watch until cancelled (or until the restart budget is spent)."""
        while True:
            await asyncio.sleep(self.interval_s)
            why = self._probe()
            if why is None:
                self.down = None  # a suspicion the probe did not confirm
                continue
            if not await self._recover(why):
                return

    async def _recover(self, why: str) -> bool:
        """Fail what is in flight and restart; False once the budget is spent."""
        log.error("%s: %s", self.name, why)
        delay = self.backoff_s
        while True:
            if self.restarts >= self.max_restarts:
                self.gave_up = True
                self.down = (
                    f"{self.name}: {why}; not restarted again (max_restarts="
                    f"{self.max_restarts} attempts made)"
                )
                self._fail(self.down)
                log.error("%s", self.down)
                return False
            attempt = self.restarts + 1
            self.down = f"{self.name}: {why}; restarting (attempt {attempt} of {self.max_restarts})"
            self._fail(self.down)
            await asyncio.sleep(delay)
            self.restarts += 1
            try:
                await self._restart()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.exception("%s: restart attempt %d failed", self.name, attempt)
                why = f"restart attempt {attempt} failed: {type(exc).__name__}: {exc}"
                delay = min(_MAX_BACKOFF_S, max(delay, 0.01) * 2)
                continue
            log.warning("%s: restarted (attempt %d)", self.name, attempt)
            self.down = None
            return True
