"""The reaper: on the orchestrator's loop every ``reaper_interval_s`` it lets the control
plane expire sessions (lease and idle timeouts, closes to retry), measures what the
engine holds for its sessions (docs/protocol.md §8) and, every ``heap_trim_interval_s``,
returns freed heap to the OS (engine/heap.py, off the loop)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from engine import heap
from engine.config import DuplexRuntimeConfig
from engine.duplex.control_plane import DuplexControl
from engine.duplex.effects import Effects
from engine.orchestration.counters import Counters
from engine.orchestration.draft_book import DraftBook
from engine.orchestration.speculation import SpeculativeAsr

log = logging.getLogger(__name__)


class Reaper:
    """``apply(effects)`` carries out what a tick starts (the orchestrator's dispatch);
    ``cleaning``: the sessions whose clean-up runs now (not handed out again)."""

    def __init__(
        self,
        config: DuplexRuntimeConfig,
        control: DuplexControl,
        counters: Counters,
        speculation: SpeculativeAsr,
        drafts: DraftBook,
        *,
        cleaning: set[str],
        apply: Callable[[Effects], None],
    ) -> None:
        self._config = config
        self._control = control
        self._counters = counters
        self._speculation = speculation
        self._drafts = drafts
        self._cleaning = cleaning
        self._apply = apply

    async def run(self) -> None:
        """Tick until cancelled; a failed tick is logged and the next one comes."""
        interval = self._config.reaper_interval_s
        trim_every = self._config.heap_trim_interval_s
        next_trim = time.monotonic() + trim_every
        while True:
            await asyncio.sleep(interval)
            try:
                now = time.monotonic()
                self._apply(self._control.tick(now, self._cleaning))
                self._counters.session_bytes = self.session_bytes()
                if trim_every > 0 and now >= next_trim and heap.can_trim():
                    next_trim = now + trim_every
                    await asyncio.to_thread(heap.trim_heap)  # ~ms; off the loop
                    self._counters.heap_trims += 1
            except Exception:
                log.exception("reaper tick failed")

    def session_bytes(self) -> dict[str, int]:
        """What the engine holds for its sessions, by part (docs/protocol.md §8)."""
        pending = history = 0
        for session in self._control.sessions.values():
            pending += session.input_bytes()
            history += session.history.nbytes
        spec = self._speculation.nbytes
        draft = self._drafts.held_bytes
        return {"engine_input": pending, "history": history, "speculation": spec, "draft": draft}
