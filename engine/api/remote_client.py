"""The front end's :class:`RemoteEngine`: the engine client (:class:`EngineClient`, the API of
the in-process :class:`~engine.api.client.AsyncEngine`) over a socket to an engine process
(engine/api/remote.py). Public client API: the server imports it.

Its link is :class:`SocketLink` (frames of engine/api/remote_wire.py on one stream socket; a
reader task hands what arrives to the client's inbox) and its figures are
:class:`PushedFigures`, the last the engine pushed.

An engine that keeps its sessions in a store (``Welcome.durable``: ``engine --state``, as
``serve --workers`` starts it) may exit and come back (its supervisor starts it again). When
its link breaks, this client does not die: calls in flight fail with
:class:`~engine.api.waiters.LinkLost` and later ones wait (``EngineClient.call`` sends them
again once the engine is back), session streams stay open, running batch jobs fail; it
connects again (every 0.1 s, up to ``restart_s``), attaches each of its open sessions again
(``ResumeCall(reattach=True)``: same lease generation), sends the appends the engine had not
yet saved (answers without ``saved``; the engine restarted from the state of the last
``saved`` answer) and lets the calls go. A session the restarted engine does not have ends
(its stream fails with :class:`EngineDeadError`); if the engine does not come back in time,
the client dies as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import Callable

import msgspec

from duplex_contract.control import ControlCall, ControlResult, ResumeCall
from duplex_contract.errors import ControlError, EngineDeadError, EngineError
from engine.api.client import EngineClient, EngineStats
from engine.api.inbox import EngineInbox
from engine.api.kept_sessions import KeptSessions
from engine.api.remote import Address, parse_address
from engine.api.remote_wire import (
    ENGINE_DECODER,
    MAX_FRAME,
    PROTOCOL,
    Hello,
    Refused,
    StatsPush,
    Welcome,
    frame,
    read_frame,
)
from engine.api.waiters import LinkLost
from engine.config import EngineConfig
from engine.messages import (
    BatchOutput,
    ControlRequest,
    EngineFatal,
    EngineRequest,
    SessionOutput,
)

log = logging.getLogger(__name__)

#: figures kept between two drains, per kind (the oldest go first)
_KEPT = 10_000
#: how often a client whose engine restarts tries to connect again
_RECONNECT_EVERY_S = 0.1


class PushedFigures:
    """The engine's figures as its process last pushed them (a few times a second)."""

    def __init__(self, first: EngineStats | None = None) -> None:
        self._stats = first
        self._latency: list[tuple[str, float]] = []
        self._steps: list[tuple[str, int]] = []
        self._waits: list[tuple[str, float]] = []
        self._decodes: list[tuple[str, float, float]] = []

    def push(self, msg: StatsPush) -> None:
        self._stats = msg.stats
        self._latency.extend(msg.stage_latency)
        self._steps.extend(msg.stage_steps)
        self._waits.extend(msg.stage_waits)
        self._decodes.extend(msg.stage_decodes)
        del self._latency[:-_KEPT], self._steps[:-_KEPT]
        del self._waits[:-_KEPT], self._decodes[:-_KEPT]

    def stats(self) -> EngineStats:
        if self._stats is None:
            raise EngineError("no figures from the engine process yet")
        return self._stats

    def drain_stage_latencies(self) -> list[tuple[str, float]]:
        out, self._latency = self._latency, []
        return out

    def drain_stage_steps(self) -> list[tuple[str, int]]:
        out, self._steps = self._steps, []
        return out

    def drain_stage_waits(self) -> list[tuple[str, float]]:
        out, self._waits = self._waits, []
        return out

    def drain_stage_decodes(self) -> list[tuple[str, float, float]]:
        out, self._decodes = self._decodes, []
        return out

    def take_over(self, fresh: PushedFigures) -> None:
        """A new engine connection's first figures (an engine that came back)."""
        self._stats = fresh._stats


class SocketLink:
    """One stream socket to an engine process: requests out as frames, and a reader task
    that hands results, events, batch items and the fatal error to the inbox and the
    figures pushes to :class:`PushedFigures`. A broken socket is the engine's death."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        inbox: EngineInbox,
        figures: PushedFigures,
        address: Address,
        on_lost: Callable[[EngineDeadError], None] | None = None,
    ) -> None:
        self.inbox = inbox
        self.figures = figures
        self.address = address
        #: the link broke (or the engine said it died): by default the engine is dead
        self.on_lost = on_lost or inbox.die
        self._writer = writer
        self._closed = False
        self._reported = False  # on_lost called (once per link)
        self._reader = asyncio.create_task(self._read(reader), name="engine-reader")

    @property
    def open(self) -> bool:
        return not self._closed

    def send(self, msg: EngineRequest) -> None:
        if not self._closed and self._writer.is_closing():
            # a write failed (the engine was killed) and the reader has not seen it yet:
            # the loss is reported now, so a caller in this window finds the link restarting
            # (an engine that keeps its sessions), not dead
            self._closed = True
            self._report("lost the engine process connection: a write failed")
        if self._closed:
            raise RuntimeError("the engine connection is closed")
        self._writer.write(frame(msg))

    def backlog(self) -> int:
        return int(self._writer.transport.get_write_buffer_size())

    async def _read(self, reader: asyncio.StreamReader) -> None:
        why = "the engine process closed the connection"
        try:
            while (body := await read_frame(reader)) is not None:
                msg = ENGINE_DECODER.decode(body)
                if isinstance(msg, StatsPush):
                    self.figures.push(msg)
                elif isinstance(msg, EngineFatal):
                    why = msg.error.message
                    break
                elif isinstance(msg, ControlResult | SessionOutput | BatchOutput):
                    self.inbox.receive(msg)
        except (ConnectionError, OSError, msgspec.DecodeError) as exc:
            why = f"lost the engine process connection: {exc}"
        finally:
            self._closed = True
            self._report(why)

    def _report(self, why: str) -> None:
        """The link broke: ``on_lost`` once (a send may see it before the reader does)."""
        self._writer.close()
        if not self._reported:
            self._reported = True
            self.on_lost(EngineDeadError(f"{why} ({self.address})"))

    async def close(self) -> None:
        """Detach from the engine (which keeps running for other front ends)."""
        self._closed = True
        self._writer.close()
        with contextlib.suppress(Exception):
            await self._writer.wait_closed()
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)


async def _handshake(
    address: Address, name: str, timeout_s: float
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, Welcome, PushedFigures]:
    """Connect, say hello, and read the welcome and the first figures."""
    try:
        if address.kind == "unix":
            opened = asyncio.open_unix_connection(address.path, limit=MAX_FRAME)
        else:
            opened = asyncio.open_connection(address.host, address.port, limit=MAX_FRAME)
        reader, writer = await asyncio.wait_for(opened, timeout_s)
    except (OSError, TimeoutError) as exc:
        raise EngineDeadError(f"cannot reach the engine at {address}: {exc}") from None
    writer.write(frame(Hello(protocol=PROTOCOL, name=name)))
    try:
        body = await asyncio.wait_for(read_frame(reader), timeout_s)
        welcome = ENGINE_DECODER.decode(body) if body is not None else None
    except (ConnectionError, TimeoutError, msgspec.DecodeError) as exc:
        writer.close()
        raise EngineDeadError(f"engine at {address} did not welcome us: {exc}") from None
    if not isinstance(welcome, Welcome):
        writer.close()
        why = welcome.message if isinstance(welcome, Refused) else "no welcome"
        raise EngineDeadError(f"engine at {address} refused the connection: {why}")
    try:  # the engine's figures follow the welcome at once
        body = await asyncio.wait_for(read_frame(reader), timeout_s)
        first = ENGINE_DECODER.decode(body) if body is not None else None
    except (ConnectionError, TimeoutError, msgspec.DecodeError) as exc:
        writer.close()
        raise EngineDeadError(f"engine at {address} went away: {exc}") from None
    figures = PushedFigures(first.stats if isinstance(first, StatsPush) else None)
    return reader, writer, welcome, figures


class ReconnectingLink:
    """The front end's link to an engine process: one :class:`SocketLink` at a time. When
    it breaks and the engine keeps its sessions (``durable``), it connects again and takes
    the sessions back (the module docstring); else the engine is dead."""

    def __init__(
        self,
        link: SocketLink,
        welcome: Welcome,
        *,
        name: str,
        restart_s: float,
    ) -> None:
        self.inbox = link.inbox
        self.figures = link.figures
        self.address = link.address
        self.name = name
        self.restart_s = restart_s
        self.engine_id = welcome.engine_id
        self.durable = welcome.durable  # the engine keeps its sessions: it comes back
        self.timeout_s = welcome.config.control_timeout_s
        self.restarts = 0  # times the engine came back
        self.kept = KeptSessions()
        self._link = link
        link.on_lost = self._lost
        self._back = asyncio.Event()
        self._back.set()
        self._restart: asyncio.Task[None] | None = None
        self._closing = False
        self._ops = itertools.count(1)
        self._op_prefix = uuid.uuid4().hex[:8]

    # ------------------------------------------------------------------ EngineLink
    @property
    def open(self) -> bool:
        return self._link.open and self._back.is_set()

    @property
    def restarting(self) -> bool:
        return not self._back.is_set() and self.inbox.dead is None

    def send(self, msg: EngineRequest) -> None:
        self._link.send(msg)

    def backlog(self) -> int:
        return self._link.backlog()

    async def until_back(self) -> None:
        await self._back.wait()

    def answered(self, call: ControlCall, result: ControlResult) -> None:
        if self.durable:
            self.kept.answered(call, result)

    async def close(self) -> None:
        """Detach from the engine (which keeps running for other front ends)."""
        self._closing = True
        if self._restart is not None and not self._restart.done():
            self._restart.cancel()
            await asyncio.gather(self._restart, return_exceptions=True)
        await self._link.close()

    # ------------------------------------------------------------------ restarts
    def _lost(self, exc: EngineDeadError) -> None:
        """The link broke: wait for an engine that keeps its sessions, else it is dead."""
        if self.inbox.dead is not None:
            return
        if self._closing or not self.durable:
            self.inbox.die(exc)
            return
        self.inbox.waiters.fail(LinkLost(exc.message))  # sent again once it is back
        self.inbox.mailboxes.end_batches(exc)
        if self._restart is None or self._restart.done():
            self._back.clear()
            log.warning("the engine went away (%s); waiting for it to come back", exc.message)
            self._restart = asyncio.create_task(self._come_back(exc), name="engine-restart")

    async def _come_back(self, exc: EngineDeadError) -> None:
        deadline = time.monotonic() + self.restart_s
        why = exc.message
        while time.monotonic() < deadline and not self._closing:
            try:
                reader, writer, welcome, figures = await _handshake(self.address, self.name, 2.0)
            except EngineDeadError as refused:
                why = refused.message
                await asyncio.sleep(_RECONNECT_EVERY_S)
                continue
            self.figures.take_over(figures)
            self._link = SocketLink(
                reader, writer, self.inbox, self.figures, self.address, self._lost
            )
            self.engine_id, self.durable = welcome.engine_id, welcome.durable
            try:
                lost = await self._reattach_all()
            except LinkLost:  # gone again meanwhile: connect again
                continue
            self.restarts += 1
            log.warning("the engine is back (%s): %d session(s) attached again, %d lost",
                        self.engine_id, len(self.kept.owned), lost)  # fmt: skip
            self._back.set()
            return
        died = f"the engine did not come back in {self.restart_s:g} s: {why}"
        self.inbox.die(EngineDeadError(died))
        self._back.set()

    async def _reattach_all(self) -> int:
        """Attach every open session again and send its unsaved appends; returns how many
        sessions the restarted engine did not have (their streams end)."""
        owned = self.kept.to_attach(self.inbox.mailboxes.has_session)
        outcomes = await asyncio.gather(*(self._reattach(sid, gen) for sid, gen in owned.items()))
        return sum(1 for kept in outcomes if not kept)

    async def _reattach(self, sid: str, generation: int) -> bool:
        op_id = f"fe-{self._op_prefix}-{next(self._ops)}"
        try:
            await self._direct(ResumeCall(sid, generation, reattach=True, operation_id=op_id))
        except ControlError as exc:  # not kept (no store row, expired), or taken over
            self.kept.forget(sid)
            gone = EngineDeadError(f"the restarted engine lost session {sid}: {exc.message}")
            self.inbox.mailboxes.lose(sid, gone)
            return False
        for append in self.kept.take_unsaved(sid):
            try:
                res = await self._direct(append)
            except ControlError as exc:  # refused now (it changes nothing): reported once
                log.warning("%s: an append sent again was refused: %s", sid, exc.message)
                continue
            self.answered(append, res)
        return True

    async def _direct(self, call: ControlCall) -> ControlResult:
        """One call while the engine comes back (the others wait for it)."""
        cid, fut = self.inbox.waiters.add()
        try:
            self._link.send(ControlRequest(control_id=cid, call=call))
        except RuntimeError as exc:
            raise LinkLost(str(exc)) from None
        try:
            async with asyncio.timeout(self.timeout_s):
                res = await fut
        except TimeoutError:
            raise ControlError("engine did not answer in time", code="deadline_exceeded") from None
        if not res.ok:
            assert res.error is not None
            raise res.error.to_exc()
        return res


class RemoteEngine(EngineClient):
    """The engine client over a socket to an engine process (a front end); create with
    ``await RemoteEngine.connect(addr)``. ``restart_s``: how long it waits for an engine
    that keeps its sessions to come back after it exits (the module docstring)."""

    def __init__(self, config: EngineConfig, inbox: EngineInbox, link: ReconnectingLink) -> None:
        super().__init__(config, inbox, link, link.figures, comeback=link)
        self.address = link.address
        self.reconnecting = link

    @property
    def engine_id(self) -> str:
        return self.reconnecting.engine_id

    @classmethod
    async def connect(
        cls,
        addr: str,
        *,
        name: str = "front-end",
        timeout_s: float = 30.0,
        restart_s: float = 120.0,
    ) -> RemoteEngine:
        address = parse_address(addr)
        reader, writer, welcome, figures = await _handshake(address, name, timeout_s)
        inbox = EngineInbox()
        socket_link = SocketLink(reader, writer, inbox, figures, address)
        link = ReconnectingLink(socket_link, welcome, name=name, restart_s=restart_s)
        return cls(welcome.config, inbox, link)


__all__ = ["PushedFigures", "ReconnectingLink", "RemoteEngine", "SocketLink"]
