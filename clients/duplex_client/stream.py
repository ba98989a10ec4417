"""The SDK's event stream: every server event once, in order, across reconnects.

:class:`EventStream` is what ``DuplexClient.events()`` reads. The connection delivers each
event it receives (a replay after a resume included); the stream drops those it already
delivered (by ``server_event_seq``), keeps the latest session object, and ends after an
event that ends the session (:func:`ends_session`) or with the error that lost the
connection. It touches no socket: events in, events out.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from duplex_client import events as ev

_TERMINAL = (ev.SessionClosed, ev.SessionExpired, ev.SessionReplaced, ev.ResyncRequired)


#: ``session.resync_required`` reasons after which the session goes on (docs/scale.md)
GOES_ON = frozenset({"front_end_lost", "engine_restarted"})


def ends_session(event: ev.AnyServerEvent) -> bool:
    """Is ``event`` the last of its session? ``session.resync_required`` after a front end
    crash (``front_end_lost``) or an engine restart (``engine_restarted``) is not: the
    session goes on, and the application re-reads what it needs."""
    if isinstance(event, ev.ResyncRequired):
        return event.reason not in GOES_ON
    return isinstance(event, _TERMINAL)


class EventStream:
    """The queue of server events a session delivers, de-duplicated by seq."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[ev.AnyServerEvent | BaseException | None] = asyncio.Queue()
        self._end = asyncio.Event()
        self.last_seq = 0  # highest server_event_seq delivered
        self.duplicates_dropped = 0  # replayed events already delivered before a drop
        self.session: ev.SessionObj | None = None  # the latest session object

    @property
    def ended(self) -> bool:
        """The session ended (a terminal event was delivered, or the connection was lost)."""
        return self._end.is_set()

    def deliver(self, event: ev.AnyServerEvent) -> None:
        """Queue ``event`` unless its seq was delivered already."""
        seq = event.server_event_seq
        if seq and seq <= self.last_seq:
            self.duplicates_dropped += 1
            return
        if seq:
            self.last_seq = seq
        if isinstance(event, ev.SessionCreated | ev.SessionUpdated):
            self.session = event.session
        self._queue.put_nowait(event)
        if ends_session(event):
            self._end.set()
            self._queue.put_nowait(None)

    def skip_to(self, seq: int) -> None:
        """Events up to ``seq`` count as delivered though not shown (``session.resumed``)."""
        self.last_seq = max(self.last_seq, seq)

    def fail(self, error: BaseException) -> None:
        """End the stream with ``error``: the reader gets it after the events before it."""
        self._end.set()
        self._queue.put_nowait(error)

    def finish(self) -> None:
        """Mark the end for the reader (after the events already queued)."""
        self._queue.put_nowait(None)

    async def wait_ended(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the session to end."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._end.wait(), timeout_s)

    async def events(self) -> AsyncIterator[ev.AnyServerEvent]:
        """Every event once, in order; ends with the stream (raises the error that ended it)."""
        while True:
            item = await self._queue.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    async def next(self, timeout_s: float | None = None) -> ev.AnyServerEvent | None:
        """The next event, or None once the stream has ended (and again on later calls)."""
        item = await asyncio.wait_for(self._queue.get(), timeout_s)
        if item is None:
            self._queue.put_nowait(None)  # keep the end visible to later calls
            return None
        if isinstance(item, BaseException):
            raise item
        return item
