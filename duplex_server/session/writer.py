"""The one writer every transport holds: a bounded outbound queue drained by one task.

:class:`QueuedWriter` is what a live session sees of its transport (the session's
:class:`~duplex_server.session.attach.Attachment`) and what the hub watches (its transport
interface: the send watchdog reads ``send_since`` and calls ``send_stalled``); it owns the
outbound queue, the link to the session it writes for (``session``) and the write loop. A
transport (the WebSocket in :mod:`duplex_server.transports.realtime`, the media transports'
:mod:`duplex_server.transports.media`) holds one and runs it (:meth:`QueuedWriter.run`) on its
:class:`Wire`, which says only how one queued item reaches the wire (:meth:`Wire.deliver`)
and how the wire closes (:meth:`Wire.finish`). The writer keeps no reference to the wire
beyond its task, so that a transport and its writer make no reference cycle: an ended
session is freed at once, not by the cyclic GC.

The loop: pop the next item (waiting while the queue is empty), deliver it with
``send_since`` set, tell the session an event was written (``LiveSession.sent``, latency
metrics), and once :meth:`QueuedWriter.close` was called and the queue is drained, ``finish``
with the close code and reason (``1000`` and ``""`` if none was given).

Slow-client policy, the same for every transport: the queue is bounded
(``output_buffer_bytes``: :meth:`QueuedWriter.send_event` returns False when it would
overflow and the session core treats that as a slow client), and a single delivery that
outlasts ``send_timeout_s`` (the hub's watchdog checks every writer's ``send_since``) cancels
the writer: the session is told (``LiveSession.too_slow``: ``error{code: client_too_slow}``,
the session closes) and the wire's :meth:`Wire.stalled` hook runs. A queue that is already
closing drops what does not fit instead: that is not a slow client.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from duplex_server.protocol.errors import CloseCode
from duplex_server.session.attach import Outbox, Outgoing
from duplex_server.session.hub import Hub
from duplex_server.session.live import LiveSession


class Wire(Protocol):
    """How a transport writes what its :class:`QueuedWriter` pops."""

    async def deliver(self, item: Outgoing, session: LiveSession | None) -> bool:
        """Write ``item`` to the wire; False if nothing of it was written as an event
        (stale audio, an event for a session no longer attached, pre-stamped bytes)."""
        ...

    async def finish(self, code: int, reason: str) -> None:
        """The queue is drained after a close: close the wire with ``code``."""
        ...

    async def stalled(self) -> None:
        """The writer was stopped as too slow (after the session was told)."""
        ...

    def writer_done(self) -> None:
        """The writer task ends, however it ends (runs last, in the task)."""
        ...


class QueuedWriter:
    """A transport's outbound queue, its session link and its one writer task
    (:meth:`run`). ``announce_replaced``: a transport taken over sends the
    ``session.replaced`` it is given before it closes (a media transport closes silently)."""

    def __init__(self, hub: Hub, *, announce_replaced: bool = True) -> None:
        self.hub = hub
        self.outbox = Outbox(hub.config.server.output_buffer_bytes)
        #: the live session this transport writes for (None: none yet, or replaced)
        self.session: LiveSession | None = None
        self.announce_replaced = announce_replaced
        #: (code, reason) once the transport is to close after what is queued
        self._close: tuple[int, str] | None = None
        self._task: asyncio.Task[None] | None = None
        self._stalled = False
        #: loop time when the item being delivered started (None: not in a send)
        self.send_since: float | None = None

    # ------------------------------------------------------------------ Attachment
    def send_event(self, item: Outgoing) -> bool:
        # a transport already closing drops what does not fit; it is not a slow client
        return self.outbox.put(item) or self._close is not None

    def send_stamped(self, data: bytes) -> None:
        self.outbox.put_raw(data)

    def purge_audio(self, below_epoch: int) -> int:
        return self.outbox.purge_audio(below_epoch)

    def take_unsent(self) -> list[Outgoing]:
        return self.outbox.drain()

    def close(self, code: int, reason: str) -> None:
        if self._close is None:
            self._close = (code, reason)
        self.outbox.wake.set()

    def replaced(self, data: bytes) -> None:
        """Another transport took the session over: later input is refused silently, what
        is queued is dropped, ``data`` (session.replaced) is sent if announced, then close."""
        self.session = None
        self.outbox.drain()
        if self.announce_replaced:
            self.outbox.put_raw(data)
        self.close(CloseCode.NORMAL, "replaced")

    @property
    def queued_bytes(self) -> int:
        return self.outbox.nbytes

    @property
    def closing(self) -> tuple[int, str] | None:
        """The close code and reason once :meth:`close` was called, else None."""
        return self._close

    # ------------------------------------------------------------------ slow client
    def send_stalled(self) -> None:
        """The watchdog saw a send outlast ``send_timeout_s``: stop the writer (too slow)."""
        task = self._task
        if task is not None and not task.done() and not self._stalled:
            self._stalled = True
            task.cancel()

    # ------------------------------------------------------------------ the writer
    async def run(self, wire: Wire) -> None:
        """The write loop onto ``wire``; run it as the transport's one writer task."""
        self.hub.ensure_watchdog()
        self._task = asyncio.current_task()
        try:
            await self._write_loop(wire)
        except asyncio.CancelledError:
            if not self._stalled:
                raise  # (before any local for the task: the error keeps this frame)
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()  # cancelled by the send watchdog: the client reads too slowly
            if self.session is not None:
                self.session.too_slow()
            await wire.stalled()
        finally:
            # (this task kept in self while its error keeps this frame would be a cycle)
            self._task = None
            wire.writer_done()

    async def _write_loop(self, wire: Wire) -> None:
        loop = asyncio.get_running_loop()
        while True:
            item = self.outbox.pop()
            if item is None:
                if self._close is not None:
                    break
                await self.outbox.wake.wait()
                continue
            session = self.session
            self.send_since = loop.time()  # the watchdog enforces send_timeout_s
            try:
                written = await wire.deliver(item, session)
            finally:
                self.send_since = None
            if written and session is not None and item.event is not None:
                session.sent(item)
        code, reason = self._close or (CloseCode.NORMAL, "")
        await wire.finish(code, reason)
