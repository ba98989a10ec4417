"""The front end's :class:`RemoteEngine`: the :class:`engine.api.client.AsyncEngine` API over a
socket to an engine process (engine/api/remote.py). Public client API: the server imports it."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace
from typing import Any

import msgspec

from duplex_contract.control import ControlResult
from duplex_contract.errors import EngineDeadError, EngineError
from engine.api.client import AsyncEngine, EngineStats
from engine.api.remote import Address, parse_address
from engine.api.remote_wire import (
    _ENGINE_DECODER,
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
from engine.messages import BatchOutput, EngineFatal, SessionOutput


class _StreamSink:
    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.closed = False

    def put_nowait(self, item: Any) -> None:
        if self.closed or self.writer.is_closing():
            raise RuntimeError("the engine connection is closed")
        self.writer.write(frame(item))

    def qsize(self) -> int:
        return int(self.writer.transport.get_write_buffer_size())


class RemoteEngine(AsyncEngine):
    """The :class:`AsyncEngine` API over a socket to an engine process (a front end)."""

    def __init__(self, config: EngineConfig, address: Address) -> None:
        super().__init__(config)
        self.address = address
        self.engine_id = ""
        self._writer: asyncio.StreamWriter | None = None
        self._sink: _StreamSink | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._stats: EngineStats | None = None
        self._latency: list[tuple[str, float]] = []
        self._steps: list[tuple[str, int]] = []
        self._waits: list[tuple[str, float]] = []
        self._decodes: list[tuple[str, float, float]] = []

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
            welcome = _ENGINE_DECODER.decode(body) if body is not None else None
        except (ConnectionError, TimeoutError, msgspec.DecodeError) as exc:
            writer.close()
            raise EngineDeadError(f"engine at {address} did not welcome us: {exc}") from None
        if not isinstance(welcome, Welcome):
            writer.close()
            why = welcome.message if isinstance(welcome, Refused) else "no welcome"
            raise EngineDeadError(f"engine at {address} refused the connection: {why}")
        self = cls(welcome.config, address)
        self.engine_id = welcome.engine_id
        try:  # the engine's figures follow the welcome at once
            body = await asyncio.wait_for(read_frame(reader), timeout_s)
            first = _ENGINE_DECODER.decode(body) if body is not None else None
        except (ConnectionError, TimeoutError, msgspec.DecodeError) as exc:
            writer.close()
            raise EngineDeadError(f"engine at {address} went away: {exc}") from None
        if isinstance(first, StatsPush):
            self._stats = first.stats
        self._writer = writer
        self._sink = _StreamSink(writer)
        self._req = self._sink
        self._reader_task = asyncio.create_task(self._read(reader), name="engine-reader")
        self._ready = True
        return self

    async def _read(self, reader: asyncio.StreamReader) -> None:
        why = "the engine process closed the connection"
        try:
            while (body := await read_frame(reader)) is not None:
                msg = _ENGINE_DECODER.decode(body)
                if isinstance(msg, ControlResult):
                    self._on_rpc(msg)
                elif isinstance(msg, StatsPush):
                    self._stats = msg.stats
                    self._latency.extend(msg.stage_latency)
                    self._steps.extend(msg.stage_steps)
                    self._waits.extend(msg.stage_waits)
                    self._decodes.extend(msg.stage_decodes)
                    del self._latency[:-10_000], self._steps[:-10_000]
                    del self._waits[:-10_000], self._decodes[:-10_000]
                elif isinstance(msg, SessionOutput | BatchOutput | EngineFatal):
                    self._on_output(msg)
        except (ConnectionError, OSError, msgspec.DecodeError) as exc:
            why = f"lost the engine process connection: {exc}"
        finally:
            self._ready = False
            if self._sink is not None:
                self._sink.closed = True
            self._die(EngineDeadError(f"{why} ({self.address})"))

    async def shutdown(self) -> None:
        """Detach from the engine (which keeps running for other front ends)."""
        async with self._shutdown_lock:
            self._ready = False
            if self._sink is not None:
                self._sink.closed = True
            if self._writer is not None:
                self._writer.close()
                with contextlib.suppress(Exception):
                    await self._writer.wait_closed()
            if self._reader_task is not None:
                self._reader_task.cancel()
                await asyncio.gather(self._reader_task, return_exceptions=True)
                self._reader_task = None
            self._die(EngineDeadError("engine shut down"))

    def stats(self) -> EngineStats:
        """The engine's figures as last pushed (a few times a second), with this front
        end's own pending calls."""
        if self._stats is None:
            raise EngineError("no figures from the engine process yet")
        return replace(self._stats, pending_calls=len(self._waiters))

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


__all__ = ["RemoteEngine"]
