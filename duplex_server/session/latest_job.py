"""One background job of a session at a time, for the helpers that work for its core off
the event loop (speech_words.py: the words of speech over an answer; turn_words.py: the
verdict on a pause's words): a newer job replaces an older one, and when the session ends
the job is cancelled and the session's ``apply`` let go (no reference cycle keeps an ended
session alive until the cyclic GC)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import Any

from duplex_server.protocol.commands import Action


class LatestJob:
    """``apply`` carries out the core's actions; ``start`` runs a job in place of the last."""

    def __init__(self, apply: Callable[[list[Action]], None]) -> None:
        self.apply = apply
        self._task: asyncio.Task[None] | None = None

    def start(self, job: Coroutine[Any, Any, None], name: str) -> None:
        self.close()
        self._task = asyncio.create_task(job, name=name)

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def close(self) -> None:
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()

    async def aclose(self) -> None:
        """The session ended: its job is cancelled and the session's ``apply`` let go."""
        task = self._task
        self.close()
        if task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.apply = _ignore


def _ignore(actions: list[Action]) -> None:
    """What an ended session's helpers reach: nothing."""
