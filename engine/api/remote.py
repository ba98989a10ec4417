"""The engine in its own process: an :class:`EngineServer` behind a socket, and the front
end's :class:`RemoteEngine`, which has the same API as the in-process :class:`AsyncEngine`.
This module holds the engine side and the addresses; the front end's client is
engine/api/remote_client.py and the frames and handshake messages are engine/api/remote_wire.py.

    duplex-server engine --config C --listen unix:///run/duplex/engine.sock   # or tcp://H:P
    duplex-server serve  --config C --engine unix:///run/duplex/engine.sock   # front end(s)

Transport: one stream socket per front end (a Unix socket or TCP), frames of a 4-byte
big-endian length and a msgpack body (msgspec structs, tagged, unknown fields refused), the
same pattern as vLLM's EngineCore client. The front end sends ``Hello`` and gets ``Welcome``
(protocol version and the engine's config); then it sends the engine requests of
engine/messages.py (control calls, batch jobs, aborts) and receives control results, session
events, batch items, periodic ``StatsPush`` and, if the engine dies, ``EngineFatal``.

Semantics are those of the in-process engine, over any number of front ends:

* control calls keep their order per front end; each result goes back to the caller's front
  end with the caller's own ``control_id``;
* a session's events go to the front end that opened (or last resumed) it, in order;
* batch items go to the front end that asked;
* the engine process dies or the socket breaks -> every pending and later call of the
  front end fails with :class:`EngineDeadError`, and session streams end with it (the server
  then closes its sessions with an error);
* a front end goes away -> its sessions are detached in the engine (they expire after the
  disconnect grace period and their slots come back) and its batch jobs are aborted;
* a front end that stops reading while more than ``max_buffer_bytes`` wait for it is
  dropped like a dead one (the engine never blocks on a slow front end).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
from opentelemetry.trace import Tracer

from duplex_contract.control import ControlResult, OpenCall, ResumeCall
from duplex_contract.errors import ConfigError, EngineDeadError, EngineError
from duplex_contract.session_events import ErrorInfo, Msg
from engine.api.client import AsyncEngine
from engine.api.remote_wire import (
    FRONT_DECODER,
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
from engine.messages import (
    AbortRequest,
    BatchOutput,
    ControlRequest,
    EngineFatal,
    GenerateRequest,
    SessionOutput,
)
from engine.stages.base import StageBackend

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Address:
    kind: str  # "unix" or "tcp"
    path: str = ""
    host: str = ""
    port: int = 0

    def __str__(self) -> str:
        return f"unix://{self.path}" if self.kind == "unix" else f"tcp://{self.host}:{self.port}"


def parse_address(addr: str) -> Address:
    """``unix:///path``, ``tcp://host:port`` (or ``host:port``, or a path starting with /)."""
    if addr.startswith("unix://"):
        path = addr[len("unix://") :]
        if not path:
            raise ConfigError(f"engine address {addr!r}: unix:// needs a path")
        return Address("unix", path=path)
    if addr.startswith("/"):
        return Address("unix", path=addr)
    rest = addr[len("tcp://") :] if addr.startswith("tcp://") else addr
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"engine address {addr!r}: expected unix:///path or tcp://host:port")
    return Address("tcp", host=host.strip("[]") or "127.0.0.1", port=int(port))


# ----------------------------------------------------------------------------- engine side
@dataclass(eq=False)
class _Conn:
    name: str
    writer: asyncio.StreamWriter
    pumps: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    batches: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    calls: set[asyncio.Task[None]] = field(default_factory=set)
    closed: bool = False


class EngineServer:
    """Runs the engine (orchestrator and stages, in this process) behind a socket."""

    def __init__(
        self,
        config: EngineConfig,
        backends: Mapping[str, Sequence[StageBackend]] | None = None,
        *,
        stats_interval_s: float = 0.5,
        max_buffer_bytes: int = 64 * 1024 * 1024,
        tracer: Tracer | None = None,
    ) -> None:
        self.config = config
        self._backends = backends
        self._tracer = tracer  # stage spans join the front ends' traces (engine/spans.py)
        self.engine_id = f"eng_{uuid.uuid4().hex[:12]}"
        self.engine: AsyncEngine | None = None
        self.address: Address | None = None
        self._server: asyncio.Server | None = None
        self._conns: set[_Conn] = set()
        self._owner: dict[str, _Conn] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stats_interval_s = stats_interval_s
        self._max_buffer = max_buffer_bytes
        self.dead = asyncio.Event()

    async def start(self, addr: str) -> Address:
        """Load the models, then listen. Returns the bound address (a tcp port 0 is
        replaced by the real one)."""
        address = parse_address(addr)
        self.engine = await AsyncEngine.start(self.config, self._backends, tracer=self._tracer)
        self.engine.on_dead(self._engine_died)
        if address.kind == "unix":
            with contextlib.suppress(FileNotFoundError):
                os.unlink(address.path)
            self._server = await asyncio.start_unix_server(
                self._handle, path=address.path, limit=MAX_FRAME
            )
        else:
            self._server = await asyncio.start_server(
                self._handle, host=address.host, port=address.port, limit=MAX_FRAME
            )
            sock = self._server.sockets[0].getsockname()
            address = Address("tcp", host=address.host, port=int(sock[1]))
        self.address = address
        self._spawn(self._push_stats(), "engine-stats")
        log.info("engine %s listening on %s", self.engine_id, address)
        return address

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for conn in list(self._conns):
            self._drop(conn, "engine stopping")
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
        if self.engine is not None:
            await self.engine.shutdown()
        if self.address is not None and self.address.kind == "unix":
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.address.path)

    def _spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    @property
    def front_ends(self) -> int:
        return len(self._conns)

    # -- connections ----------------------------------------------------------------
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn: _Conn | None = None
        try:
            body = await asyncio.wait_for(read_frame(reader), 10.0)
            hello = FRONT_DECODER.decode(body) if body is not None else None
            if not isinstance(hello, Hello) or hello.protocol != PROTOCOL:
                writer.write(frame(Refused(message=f"expected hello, protocol {PROTOCOL}")))
                return
            engine = self.engine
            if engine is None or not engine.ready:
                writer.write(frame(Refused(message="the engine is not running")))
                return
            conn = _Conn(name=hello.name or "front-end", writer=writer)
            self._conns.add(conn)
            durable = self.config.duplex.store_path is not None
            welcome = Welcome(
                protocol=PROTOCOL, engine_id=self.engine_id, config=self.config, durable=durable
            )
            writer.write(frame(welcome))
            self._send(conn, StatsPush(stats=engine.stats()))  # figures from the start
            log.info("front end %s attached (%d attached)", conn.name, len(self._conns))
            while (body := await read_frame(reader)) is not None:
                self._dispatch(conn, engine, FRONT_DECODER.decode(body))
        except (ConnectionError, TimeoutError, msgspec.DecodeError, OSError) as exc:
            log.warning("front end %s: %s", conn.name if conn else "?", exc)
        finally:
            if conn is not None:
                self._drop(conn, "front end went away")
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    def _send(self, conn: _Conn, msg: Msg) -> None:
        if conn.closed:
            return
        conn.writer.write(frame(msg))
        if conn.writer.transport.get_write_buffer_size() > self._max_buffer:
            log.error("front end %s stopped reading; dropping it", conn.name)
            self._drop(conn, "front end too slow")

    def _drop(self, conn: _Conn, why: str) -> None:
        if conn.closed:
            return
        conn.closed = True
        self._conns.discard(conn)
        owned = [sid for sid, c in self._owner.items() if c is conn]
        for sid in owned:
            del self._owner[sid]
        for task in [*conn.pumps.values(), *conn.batches.values(), *conn.calls]:
            task.cancel()
        engine = self.engine
        if owned and engine is not None and engine.ready:
            with contextlib.suppress(EngineError):
                engine.detach(tuple(owned))
        conn.writer.close()
        log.info("front end %s detached (%s): %d sessions detached", conn.name, why, len(owned))

    def _dispatch(self, conn: _Conn, engine: AsyncEngine, msg: Any) -> None:
        if isinstance(msg, ControlRequest):
            try:
                fut = engine.submit(msg.call)
            except EngineError as exc:
                self._send(
                    conn,
                    ControlResult(
                        control_id=msg.control_id, ok=False, error=ErrorInfo.from_exc(exc)
                    ),
                )
                return
            task = asyncio.create_task(self._answer(conn, engine, msg, fut))
            conn.calls.add(task)
            task.add_done_callback(conn.calls.discard)
        elif isinstance(msg, GenerateRequest):
            task = asyncio.create_task(self._generate(conn, engine, msg))
            conn.batches[msg.request_id] = task
        elif isinstance(msg, AbortRequest):
            running = conn.batches.get(msg.request_id)
            if running is not None:
                running.cancel()
        else:
            raise ConnectionError(f"unexpected {type(msg).__name__} from a front end")

    async def _answer(
        self,
        conn: _Conn,
        engine: AsyncEngine,
        msg: ControlRequest,
        fut: asyncio.Future[ControlResult],
    ) -> None:
        try:
            res = await fut
        except EngineError as exc:
            res = ControlResult(control_id=msg.control_id, ok=False, error=ErrorInfo.from_exc(exc))
        sid = res.session_id
        owns = isinstance(msg.call, OpenCall) or (
            isinstance(msg.call, ResumeCall) and not msg.call.peek
        )
        if res.ok and sid is not None and owns:
            self._own(conn, engine, sid)
        self._send(conn, replace_id(res, msg.control_id))

    def _own(self, conn: _Conn, engine: AsyncEngine, sid: str) -> None:
        prev = self._owner.get(sid)
        if prev is conn and sid in conn.pumps:
            return
        if prev is not None:  # resumed through another front end: its stream moves
            pump = prev.pumps.pop(sid, None)
            if pump is not None:
                pump.cancel()
        self._owner[sid] = conn
        conn.pumps[sid] = asyncio.create_task(self._pump(conn, engine, sid), name=f"pump:{sid}")

    async def _pump(self, conn: _Conn, engine: AsyncEngine, sid: str) -> None:
        try:
            async for event in engine.session_events(sid):
                self._send(conn, SessionOutput(session_id=sid, event=event))
        except EngineDeadError:
            pass  # EngineFatal goes to every front end
        finally:
            if conn.pumps.get(sid) is asyncio.current_task():
                del conn.pumps[sid]
                if self._owner.get(sid) is conn:
                    del self._owner[sid]

    async def _generate(self, conn: _Conn, engine: AsyncEngine, msg: GenerateRequest) -> None:
        rid = msg.request_id
        try:
            async for item in engine.generate(msg.job, rid):
                self._send(conn, BatchOutput(request_id=rid, item=item))
        except EngineDeadError:
            pass
        except EngineError as exc:
            self._send(
                conn, BatchOutput(request_id=rid, error=ErrorInfo.from_exc(exc, request_id=rid))
            )
        finally:
            conn.batches.pop(rid, None)

    def _engine_died(self, exc: EngineDeadError) -> None:
        info = ErrorInfo.from_exc(exc)
        for conn in list(self._conns):
            self._send(conn, EngineFatal(error=info))
            self._drop(conn, "engine died")
        self.dead.set()

    async def _push_stats(self) -> None:
        while True:
            await asyncio.sleep(self._stats_interval_s)
            engine = self.engine
            if engine is None or not engine.ready or not self._conns:
                continue
            push = StatsPush(
                stats=engine.stats(),
                stage_latency=engine.drain_stage_latencies(),
                stage_steps=engine.drain_stage_steps(),
                stage_waits=engine.drain_stage_waits(),
                stage_decodes=engine.drain_stage_decodes(),
            )
            for conn in list(self._conns):
                self._send(conn, push)


def replace_id(res: ControlResult, control_id: int) -> ControlResult:
    return msgspec.structs.replace(res, control_id=control_id)


async def serve_engine(config: EngineConfig, addr: str, tracer: Tracer | None = None) -> None:
    """``duplex-server engine``: run until cancelled (SIGINT/SIGTERM) or the engine dies.
    ``tracer``: stage spans in the front ends' traces (their ``traceparent`` on the calls)."""
    server = EngineServer(config, tracer=tracer)
    try:
        bound = await server.start(addr)
        assert server.engine is not None
        kept = len(server.engine.orchestrator.control.sessions)
        print(
            f"duplex-server engine {server.engine_id} listening on {bound}"
            + (f" ({kept} session(s) taken back from the store)" if kept else ""),
            flush=True,
        )
        await server.dead.wait()
        raise SystemExit("the engine died")
    finally:
        await server.stop()


__all__ = [
    "Address",
    "EngineServer",
    "parse_address",
    "serve_engine",
]
