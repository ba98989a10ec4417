"""The control calls waiting for their results: one future per ``control_id``.

A result resolves its caller's future; one that finds no waiter (its caller timed out or
went away) is dropped and counted in :attr:`CallWaiters.late_replies`. The engine's death
fails every waiter at once (:meth:`CallWaiters.fail`). A waiter leaves the table as soon as
its future is done, whatever ended it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging

from duplex_contract.control import ControlResult

log = logging.getLogger(__name__)


class LinkLost(Exception):
    """The link to the engine broke with the call in flight, and the engine comes back (it
    keeps its sessions: engine/api/remote_client.py): the caller sends the call again, with
    its ``operation_id``, once the engine is back."""


class CallWaiters:
    """The futures of the control calls sent and not yet answered, by ``control_id``."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._futures: dict[int, asyncio.Future[ControlResult]] = {}
        #: results that came after their caller stopped waiting (dropped)
        self.late_replies = 0

    def add(self) -> tuple[int, asyncio.Future[ControlResult]]:
        """A new ``control_id`` and the future its result resolves."""
        cid = next(self._ids)
        fut: asyncio.Future[ControlResult] = asyncio.get_running_loop().create_future()
        self._futures[cid] = fut
        fut.add_done_callback(lambda _: self._futures.pop(cid, None))
        return cid, fut

    def resolve(self, result: ControlResult) -> None:
        """A result arrived: wake its caller (``ok`` False included)."""
        fut = self._futures.pop(result.control_id, None)
        if fut is None or fut.done():
            self.late_replies += 1
            log.info("dropped late control reply %s", result.control_id)
            return
        fut.set_result(result)

    def fail(self, exc: BaseException) -> None:
        """Fail every waiting call with ``exc`` (the engine is gone)."""
        futures = list(self._futures.values())
        self._futures.clear()
        for fut in futures:
            if not fut.done():
                fut.set_exception(exc)

    def __len__(self) -> int:
        return len(self._futures)
