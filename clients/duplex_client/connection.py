"""The SDK's connection: the session's socket, reopened and resumed when it drops.

:class:`Connection` opens the session (``session.created``, or the refusal as
:class:`~duplex_client.errors.SessionRefused`), reads server events into the
:class:`~duplex_client.stream.EventStream`, and sends: a send made while the socket is
being replaced waits for the new one. When the socket drops it reconnects (with backoff,
on a ``?intent=resume`` socket named by ``session.created``'s ``resume_query``, so a load
balancer sends it to the front end that holds the session), sends ``session.resume``,
delivers the replay to the stream (which drops what it already delivered), stores the
rotated token, and has the :class:`~duplex_client.resend.InputLog` send again the input the
server lacks before anything else. A heartbeat task sends ``session.heartbeat`` and
acknowledges received events (``session.event_ack``) so the server can trim its journal.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

import msgspec
import websockets
from websockets.asyncio.client import ClientConnection

from duplex_client import events as ev
from duplex_client.errors import ConnectionLost, SessionRefused
from duplex_client.resend import InputLog
from duplex_client.stream import EventStream
from duplex_client.wire import decode_event, encode_event

log = logging.getLogger(__name__)

#: a resume refused with these is tried again (the load balancer may pick another front end)
RETRY_CODES = frozenset({"server_draining", "engine_unavailable"})
#: how long one resume attempt waits for the socket and for each replayed event
RESUME_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ResumePolicy:
    """How hard a dropped connection is resumed: ``attempts`` tries, the wait between them
    doubling from ``backoff_s`` up to ``max_backoff_s``."""

    attempts: int = 5
    backoff_s: float = 0.2
    max_backoff_s: float = 5.0


async def recv_event(ws: ClientConnection) -> ev.AnyServerEvent:
    """The next server event on ``ws``; an event this SDK does not know is skipped."""
    while True:
        data = await ws.recv()
        try:
            return decode_event(data)
        except msgspec.ValidationError as exc:  # a newer server's event: skip it
            log.debug("skipping undecodable server event: %s", exc)


class _Retry(Exception):
    """One resume attempt failed in a way the next attempt may not."""


class Connection:
    """One session's socket and the tasks that keep it: the reader (which resumes a
    dropped socket) and the heartbeat."""

    def __init__(
        self,
        url: str,
        headers: dict[str, str],
        *,
        stream: EventStream,
        inputs: InputLog,
        policy: ResumePolicy,
    ) -> None:
        self.url = url
        self.session_id = ""
        self.resume_token = ""
        self.resume_query = "intent=resume"
        self.resumes = 0  # transparent resumes so far
        self.resumed_at: float | None = None  # time.monotonic() of the last resume
        self.closing = False
        self._headers = headers
        self._stream = stream
        self._inputs = inputs
        self._policy = policy
        self._ws: ClientConnection | None = None
        self._connected = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    # ------------------------------------------------------------------ open / close
    async def open_session(self, timeout_s: float) -> ev.SessionCreated:
        """Open the socket and wait for ``session.created``; raises SessionRefused."""
        ws = await self._open(timeout_s)
        first = await asyncio.wait_for(recv_event(ws), timeout_s)
        if not isinstance(first, ev.SessionCreated):
            await ws.close()
            if isinstance(first, ev.Error):
                err = first.error
                raise SessionRefused(
                    f"the server refused the session: {err.message} ({err.code})", err.code
                )
            raise SessionRefused(f"expected session.created, got {type(first).__name__}")
        self.session_id, self.resume_token = first.session.id, first.resume_token
        self.resume_query = first.resume_query  # where a load balancer sends our resume
        self._attach(ws)
        return first

    def start(self, heartbeat_s: float) -> None:
        """Start the reader and the heartbeat (after :meth:`open_session`)."""
        self._tasks = [
            asyncio.create_task(self._read_loop(), name=f"duplex-read-{self.session_id}"),
            asyncio.create_task(
                self._heartbeat_loop(heartbeat_s), name=f"duplex-beat-{self.session_id}"
            ),
        ]

    async def close(self) -> None:
        """Send ``session.close`` (waiting up to 5 s for the session to end), stop the
        tasks and close the socket; idempotent."""
        if self.closing:
            return
        self.closing = True
        ws = self._ws
        if ws is not None and self._connected.is_set() and not self._stream.ended:
            with contextlib.suppress(websockets.ConnectionClosed):
                await ws.send(encode_event(ev.SessionClose()))
                await self._stream.wait_ended(5.0)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._ws is not None:
            await self._ws.close()

    async def _open(self, timeout_s: float, *, resume: bool = False) -> ClientConnection:
        url = self.url
        if resume:  # the server waits for session.resume instead of opening a new session;
            # the query names the front end that owns the session (behind a load balancer)
            url += ("&" if "?" in url else "?") + self.resume_query
        try:
            return await websockets.connect(
                url,
                additional_headers=self._headers,
                max_size=None,
                open_timeout=timeout_s,
                ping_interval=None,  # the protocol heartbeat keeps the lease alive
            )
        except websockets.InvalidStatus as exc:
            raise SessionRefused(f"handshake refused: HTTP {exc.response.status_code}") from None

    def _attach(self, ws: ClientConnection) -> None:
        self._ws = ws
        self._connected.set()

    # ------------------------------------------------------------------ sending
    async def send(self, data: str | bytes, input_seq: int | None = None) -> None:
        """Send ``data`` on the current socket, waiting for a new one while the reader
        resumes. Input message ``input_seq`` is kept for a resend first, and not sent again
        here if the resume sent it (never twice)."""
        if input_seq is not None:
            self._inputs.add(input_seq, data)
        while True:
            if self._stream.ended:
                raise ConnectionLost("the session has ended")
            await self._connected.wait()
            if input_seq is not None and self._inputs.sent_by_resume(input_seq):
                return
            ws = self._ws
            assert ws is not None
            try:
                await ws.send(data)
                return
            except websockets.ConnectionClosed:
                self._connected.clear()  # the reader resumes; send again on the new socket

    async def _heartbeat_loop(self, every_s: float) -> None:
        acked = 0
        while not self._stream.ended:
            await asyncio.sleep(every_s)
            with contextlib.suppress(ConnectionLost):
                await self.send(encode_event(ev.SessionHeartbeat()))
                last_seq = self._stream.last_seq
                if last_seq > acked:
                    acked = last_seq
                    await self.send(encode_event(ev.SessionEventAck(seq=last_seq)))

    # ------------------------------------------------------------------ reading, resuming
    async def _read_loop(self) -> None:
        while not self._stream.ended:
            ws = self._ws
            assert ws is not None
            try:
                event = await recv_event(ws)
            except websockets.ConnectionClosed:
                if self.closing or self._stream.ended:
                    break
                self._connected.clear()
                try:
                    await self._resume()
                except ConnectionLost as exc:
                    self._stream.fail(exc)
                    break
                continue
            if isinstance(event, ev.SessionResumed):
                self.resume_token = event.resume_token
                continue
            self._stream.deliver(event)

    async def _resume(self) -> None:
        """Reconnect and resume the session; replayed events are de-duplicated by seq."""
        delay = self._policy.backoff_s
        last_error = "connection dropped"
        for attempt in range(1, self._policy.attempts + 1):
            try:
                ws = await self._open(RESUME_TIMEOUT_S, resume=True)
            except (OSError, TimeoutError, SessionRefused, websockets.InvalidHandshake) as exc:
                last_error = f"{type(exc).__name__}: {exc}"
                log.info("resume attempt %d failed: %s", attempt, last_error)
            else:
                try:
                    reply = await self._resume_on(ws)
                except _Retry as exc:
                    last_error = str(exc)
                else:
                    self.resume_token = reply.resume_token
                    self._stream.skip_to(reply.server_event_seq)  # not shown to the user
                    self.resumes += 1
                    self.resumed_at = time.monotonic()
                    self._attach(ws)
                    log.info("session %s resumed (%d replayed)", self.session_id, reply.replayed)
                    return
            await asyncio.sleep(delay)
            delay = min(delay * 2, self._policy.max_backoff_s)
        raise ConnectionLost(f"could not resume session {self.session_id}: {last_error}")

    async def _resume_on(self, ws: ClientConnection) -> ev.SessionResumed:
        """One resume on the fresh socket ``ws``: ``session.resume``, the replay, then the
        input the server lacks. Raises _Retry (this attempt failed) or ConnectionLost (the
        server refused the session for good)."""
        resume = ev.SessionResume(
            session_id=self.session_id,
            resume_token=self.resume_token,
            last_received_server_event_seq=self._stream.last_seq,
        )
        try:
            await ws.send(encode_event(resume))
            # The server replays journaled events, then confirms with session.resumed.
            while True:
                reply = await asyncio.wait_for(recv_event(ws), RESUME_TIMEOUT_S)
                if isinstance(reply, ev.SessionResumed):
                    break
                if isinstance(reply, ev.Error) and reply.error.code in RETRY_CODES:
                    raise TimeoutError(f"resume refused for now: {reply.error.code}")
                if isinstance(reply, ev.Error | ev.SessionClosed | ev.SessionExpired):
                    await ws.close()
                    self._stream.deliver(reply)
                    raise ConnectionLost(f"resume refused: {reply!r}")
                self._stream.deliver(reply)
        except (websockets.ConnectionClosed, TimeoutError) as exc:
            await ws.close()
            raise _Retry(f"{type(exc).__name__}: {exc}") from exc
        try:
            await self._inputs.resend(ws.send, reply.last_input_seq)
        except websockets.ConnectionClosed as exc:
            raise _Retry(f"{type(exc).__name__}: {exc}") from exc
        return reply
