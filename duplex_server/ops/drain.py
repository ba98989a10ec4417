"""Drain on deploy: SIGTERM takes a front end out of service without dropping a call.

:func:`drain` (the order matters):

1. the front end stops taking sessions: ``/health`` answers 503 ``draining`` (HAProxy's
   checks take it out), new sessions and resumes are refused (``server_draining``, close
   1013; a client retries and the load balancer sends it elsewhere);
2. answers in flight get up to ``server.drain_s`` to finish (one still running then is
   cancelled: ``response.done{cancelled}``, reason ``server_draining``), and ``/health``
   stays ``draining`` for at least ``server.drain_health_s``;
3. every session is handed over: its replica in the engine is brought up to date (marked
   handed over at the seq of the event that follows), then ``session.handover`` is sent and
   the socket closed with 1012. The client resumes through the load balancer; the front end
   that gets the resume takes the session over (``Sessions.adopt``,
   duplex_server/session/registry.py) with nothing lost.

:func:`shut_down` is the end of a server whose sessions no other process can take over (the
single-process ``duplex-server serve``: its engine stops with it): no new sessions, answers in
flight get up to ``server.drain_s``, then every session is told it is over and cannot be
resumed (``error{server_shutdown}``, ``session.closed{server_shutdown}``, close 1001:
docs/protocol.md §10), so clients stop retrying and say why. Without it uvicorn closed the
sockets with 1012 and the clients tried to resume on a server that was gone.

:class:`DrainingServer` is uvicorn's server with those signals mapped to a drain (``handover``:
SIGTERM hands sessions over; SIGINT stops at once) or to :func:`shut_down` (SIGTERM and
SIGINT), followed by the usual ordered shutdown; a second signal stops at once.
``FINAL_STOP`` (SIGUSR1) is :func:`shut_down` for a front end that would hand its sessions
over: ``serve --workers`` stopping for good sends it, since no front end is left to take them
(duplex_server/ops/supervise.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
import time
from collections.abc import Iterator
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn

from duplex_server.ops.supervise import FINAL_STOP
from duplex_server.protocol import events as ev
from duplex_server.protocol.errors import CloseCode, SessionFatal
from duplex_server.session.live import LiveSession

if TYPE_CHECKING:
    from duplex_server.session.hub import Hub

log = logging.getLogger(__name__)

_FLUSH_S = 1.0  # the longest wait for a socket's queued events before the handover
_HANDOVER_TRIES = 5  # replicas written while events keep coming, before a resync is said


async def drain(hub: Hub, drain_s: float, health_s: float) -> int:
    """Drain ``hub``; returns how many sessions were handed over."""
    hub.draining = True
    live = hub.sessions.live
    log.info("draining: %d session(s), up to %.1f s for answers in flight", len(live), drain_s)
    start = time.monotonic()
    while time.monotonic() - start < drain_s:
        busy = [s for s in live.values() if s.core.responses.active and not s.core.closed]
        if not busy and time.monotonic() - start >= health_s:
            break
        await asyncio.sleep(0.05)
    sessions = [s for s in live.values() if not s.core.closed]
    await asyncio.gather(*(hand_over(s) for s in sessions))
    log.info(
        "drained: %d session(s) handed over in %.1f s", len(sessions), time.monotonic() - start
    )
    return len(sessions)


async def hand_over(session: LiveSession) -> None:
    """Send ``session`` to another front end: replica first, then the client is told."""
    session.apply(session.core.cut_for_handover())  # an answer still running: cancelled
    for _ in range(_HANDOVER_TRIES):
        await _flushed(session)
        seq = session.stamper.seq + 1  # the handover event's
        await session.replicate(handed_over_at=seq)
        if session.core.closed:
            await session.replicate()
            return
        if session.stamper.seq + 1 == seq and not _unsent(session):
            break  # the replica holds all the client is sent before the handover
        # an event came meanwhile (the end of the answer cut, from the engine; a heartbeat's
        # ack): it goes to the client before the handover, and the replica is written again
    else:
        await _flushed(session)
        await session.replicate()  # events keep coming: the taker must say resync
    session.handed_over_at = seq = session.stamper.seq + 1
    att = session.attachment
    data = session.stamper.stamp(ev.SessionHandover(), time.monotonic())
    if att is not None:
        att.send_stamped(data)
        att.close(CloseCode.SERVICE_RESTART, "server_draining")


def _unsent(session: LiveSession) -> int:
    """Bytes queued for the client and not yet written (nor stamped)."""
    att = session.attachment
    return att.queued_bytes if att is not None else 0


async def _flushed(session: LiveSession) -> None:
    """Until the engine has the session's calls and the client what it was sent (at most
    ``_FLUSH_S``)."""
    deadline = time.monotonic() + _FLUSH_S
    while time.monotonic() < deadline and (session.calls_waiting or _unsent(session)):  # noqa: ASYNC110
        await asyncio.sleep(0.01)


async def shut_down(hub: Hub, drain_s: float) -> int:
    """End every session of ``hub`` for good (see the module docstring); returns how many
    were told."""
    hub.draining = True  # new sessions and resumes: server_draining (1013)
    live = hub.sessions.live
    log.info("shutting down: %d session(s), up to %.1f s for answers in flight", len(live), drain_s)
    start = time.monotonic()
    while time.monotonic() - start < drain_s:
        if not any(s.core.responses.active and not s.core.closed for s in live.values()):
            break
        await asyncio.sleep(0.05)
    sessions = [s for s in live.values() if not s.core.closed]
    notice = SessionFatal(
        "server_shutdown",
        "the server is shutting down; this session has ended and cannot be resumed",
    )
    for session in sessions:
        session.apply(session.core.cut_for_handover("server_shutdown"))  # drain_s was up
        session.apply(session.core.close("server_shutdown", notice))
    deadline = time.monotonic() + _FLUSH_S
    while time.monotonic() < deadline and any(  # noqa: ASYNC110
        s.attachment is not None and s.attachment.queued_bytes for s in sessions
    ):
        await asyncio.sleep(0.01)  # the notices reach their sockets
    log.info("told %d session(s) the server stops (server_shutdown, 1001)", len(sessions))
    return len(sessions)


class DrainingServer(uvicorn.Server):
    """uvicorn's server; the first SIGTERM (``handover``) or SIGTERM/SIGINT (else) drains
    ``hub`` before the ordered shutdown."""

    def __init__(
        self,
        config: uvicorn.Config,
        hub: Hub,
        drain_s: float,
        health_s: float,
        *,
        handover: bool = True,
    ):
        super().__init__(config)
        self.hub = hub
        self.drain_s = drain_s
        self.health_s = health_s
        self.handover = handover
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task[int] | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's SIGINT and SIGTERM, and :data:`FINAL_STOP` (main thread only)."""
        with super().capture_signals():
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = signal.signal(FINAL_STOP, self._final_stop)
            try:
                yield
            finally:
                signal.signal(FINAL_STOP, previous)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        loop = self._loop
        drains = (signal.SIGTERM,) if self.handover else (signal.SIGTERM, signal.SIGINT)
        if sig not in drains or self._drain is not None or loop is None or not self.started:
            super().handle_exit(sig, frame)
            return
        loop.call_soon_threadsafe(self._start_drain, False)

    def _final_stop(self, sig: int, frame: FrameType | None) -> None:
        loop = self._loop
        if self._drain is not None or loop is None or not self.started:
            super().handle_exit(signal.SIGTERM, frame)  # stop now, as a second signal does
            return
        loop.call_soon_threadsafe(self._start_drain, True)

    def _start_drain(self, final: bool) -> None:
        if self._drain is None:
            self._drain = asyncio.ensure_future(self._drain_then_exit(final))

    async def _drain_then_exit(self, final: bool) -> int:
        try:
            if self.handover and not final:
                return await drain(self.hub, self.drain_s, self.health_s)
            return await shut_down(self.hub, self.drain_s)
        except Exception:
            log.exception("drain failed; shutting down")
            return 0
        finally:
            with contextlib.suppress(Exception):
                await asyncio.sleep(0.2)  # the handover frames reach their sockets
            self.should_exit = True
