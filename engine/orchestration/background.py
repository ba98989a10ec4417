"""Tasks of the orchestrator that nobody awaits (stage aborts, clean-ups, a cancelled runner
unwinding): kept until they end, so shutdown can cancel and await every one."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from engine.tasks import reap


class BackgroundTasks:
    """The orchestrator loop's unawaited tasks; each leaves the set when it ends."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> None:
        """Run ``coro`` as a task of its own, kept until it ends."""
        self.track(asyncio.create_task(coro, name=name))

    def track(self, task: asyncio.Task[Any]) -> None:
        """Keep a task that nobody awaits; its outcome is read when it ends (``reap``)."""
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(reap)

    def tasks(self) -> list[asyncio.Task[Any]]:
        """The tasks not ended yet (shutdown cancels and awaits them)."""
        return list(self._tasks)
