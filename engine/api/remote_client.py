"""The front end's :class:`RemoteEngine`: the engine client (:class:`EngineClient`, the API of
the in-process :class:`~engine.api.client.AsyncEngine`) over a socket to an engine process
(engine/api/remote.py). Public client API: the server imports it.

Its link is :class:`SocketLink` (frames of engine/api/remote_wire.py on one stream socket; a
reader task hands what arrives to the client's inbox) and its figures are
:class:`PushedFigures`, the last the engine pushed.
"""

from __future__ import annotations

import asyncio
import contextlib

import msgspec

from duplex_contract.control import ControlResult
from duplex_contract.errors import EngineDeadError, EngineError
from engine.api.client import EngineClient, EngineStats
from engine.api.inbox import EngineInbox
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
from engine.config import EngineConfig
from engine.messages import BatchOutput, EngineFatal, EngineRequest, SessionOutput

#: figures kept between two drains, per kind (the oldest go first)
_KEPT = 10_000


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
    ) -> None:
        self.inbox = inbox
        self.figures = figures
        self.address = address
        self._writer = writer
        self._closed = False
        self._reader = asyncio.create_task(self._read(reader), name="engine-reader")

    @property
    def open(self) -> bool:
        return not self._closed

    def send(self, msg: EngineRequest) -> None:
        if self._closed or self._writer.is_closing():
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
                elif isinstance(msg, ControlResult | SessionOutput | BatchOutput | EngineFatal):
                    self.inbox.receive(msg)
        except (ConnectionError, OSError, msgspec.DecodeError) as exc:
            why = f"lost the engine process connection: {exc}"
        finally:
            self._closed = True
            self.inbox.die(EngineDeadError(f"{why} ({self.address})"))

    async def close(self) -> None:
        """Detach from the engine (which keeps running for other front ends)."""
        self._closed = True
        self._writer.close()
        with contextlib.suppress(Exception):
            await self._writer.wait_closed()
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)


class RemoteEngine(EngineClient):
    """The engine client over a socket to an engine process (a front end); create with
    ``await RemoteEngine.connect(addr)``."""

    def __init__(
        self,
        config: EngineConfig,
        inbox: EngineInbox,
        link: SocketLink,
        engine_id: str,
    ) -> None:
        super().__init__(config, inbox, link, link.figures)
        self.address = link.address
        self.engine_id = engine_id

    @classmethod
    async def connect(
        cls, addr: str, *, name: str = "front-end", timeout_s: float = 30.0
    ) -> RemoteEngine:
        address = parse_address(addr)
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
        inbox = EngineInbox()
        link = SocketLink(reader, writer, inbox, figures, address)
        return cls(welcome.config, inbox, link, welcome.engine_id)


__all__ = ["PushedFigures", "RemoteEngine", "SocketLink"]
