"""Batch admission: real-time sessions keep priority over batch requests.

Stage queues already order real-time work first, but on a small CPU a batch request that
is *running* competes for the same cores. So batch jobs are admitted one at a time, and
their stage requests only while no session is inside its time-to-first-audio window (from
the start of a turn's work until its first audio or text leaves the engine). A session's
turn can then wait on at most the stage requests of the one batch job already running
when it began.

The slot belongs to the job, not to one stage request: the stage requests of the job that
holds it pass (:func:`batch_job` names the job from a request id). A job's output stages
form a chain (talker -> codec on the AR-to-TTS route): with one slot per stage request,
the codec's first window waited for the talker's whole segment to end, so a batch
``/v1/audio/speech`` on that route did not stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from engine.messages import Priority


def batch_job(request_id: str) -> str:
    """The batch job a stage request belongs to: ``batch/<id>`` of ``batch/<id>/talker0``
    (engine/orchestration/batch_jobs.py names every stage request of a job under that prefix)."""
    return "/".join(request_id.split("/", 2)[:2])


class BatchAdmission:
    """Create and use on one event loop (the orchestrator's)."""

    def __init__(self, concurrency: int = 1) -> None:
        self._critical: set[str] = set()
        self._clear = asyncio.Event()
        self._clear.set()
        self._slots = asyncio.Semaphore(concurrency)
        #: job -> its stage requests holding or waiting under its slot
        self._jobs: dict[str, int] = {}
        self.waits = 0  # batch stage requests that had to wait for a session

    @property
    def critical(self) -> int:
        return len(self._critical)

    def enter_critical(self, key: str) -> None:
        self._critical.add(key)
        self._clear.clear()

    def leave_critical(self, key: str) -> None:
        self._critical.discard(key)
        if not self._critical:
            self._clear.set()

    @property
    def jobs(self) -> int:
        """Batch jobs holding a slot now."""
        return len(self._jobs)

    @asynccontextmanager
    async def slot(self, priority: Priority, job: str = "") -> AsyncIterator[None]:
        """Hold for the whole of one stage request of ``job``; real-time requests pass
        straight. The first of a job's requests takes the job's slot (waiting for one while
        other jobs hold them all); the job's other requests share it; the last to end gives
        it back."""
        if priority != Priority.BATCH:
            yield
            return
        if job in self._jobs:
            self._jobs[job] += 1
        else:
            await self._slots.acquire()
            self._jobs[job] = 1
        try:
            if not self._clear.is_set():
                self.waits += 1
            while not self._clear.is_set():
                await self._clear.wait()
            yield
        finally:
            self._jobs[job] -= 1
            if not self._jobs[job]:
                del self._jobs[job]
                self._slots.release()
