"""Small asyncio task helpers that keep ended work from lingering in reference cycles.

A task that ends with an exception keeps it, and the exception's traceback keeps every frame
it passed through with their locals. When one of those frames refers back to the task (a
local holding ``asyncio.current_task()``, or an object that holds the task), the task, the
frames and all they reference (a session's history, its audio) form a cycle that only
Python's cyclic garbage collector frees, seconds later and all at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any


def cancelling() -> bool:
    """Is the running task being cancelled (not just something it awaited)? Call this
    instead of keeping the task in a local of a frame that may re-raise."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def reap(task: asyncio.Task[Any]) -> None:
    """A done callback for a task nobody awaits: read its outcome, so asyncio does not log
    an exception as never retrieved, and take a cancelled task's ``CancelledError`` from it
    (a cancelled task keeps it until it is read)."""
    if task.cancelled():
        with contextlib.suppress(asyncio.CancelledError):
            task.result()
    else:
        task.exception()
