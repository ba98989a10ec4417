"""Batch admission: real-time sessions keep priority over batch requests.

Stage queues already order real-time work first, but on a small CPU a batch request that
is *running* competes for the same cores. So batch stage requests are admitted one at a
time, and only while no session is inside its time-to-first-audio window (from the start
of a turn's work until its first audio or text leaves the engine). A session's turn can
then wait on at most the one batch stage request already running when it began.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from engine.messages import Priority


class BatchAdmission:
    """Create and use on one event loop (the orchestrator's)."""

    def __init__(self, concurrency: int = 1) -> None:
        self._critical: set[str] = set()
        self._clear = asyncio.Event()
        self._clear.set()
        self._slots = asyncio.Semaphore(concurrency)
        self.waits = 0  # batch stage requests that had to wait for a session

    @property
    def critical(self) -> int:
        return len(self._critical)

    def critical_besides(self, session_id: str) -> bool:
        """Is a session other than ``session_id`` inside its time-to-first-audio window?
        (keys are fence keys, ``sess_x/e0/t1/r1``)"""
        own = session_id + "/"
        return any(not key.startswith(own) for key in self._critical)

    def enter_critical(self, key: str) -> None:
        self._critical.add(key)
        self._clear.clear()

    def leave_critical(self, key: str) -> None:
        self._critical.discard(key)
        if not self._critical:
            self._clear.set()

    @asynccontextmanager
    async def slot(self, priority: Priority) -> AsyncIterator[None]:
        """Hold for the whole of one stage request; real-time requests pass straight."""
        if priority != Priority.BATCH:
            yield
            return
        async with self._slots:
            if not self._clear.is_set():
                self.waits += 1
            while not self._clear.is_set():
                await self._clear.wait()
            yield
