"""A GPT-Live session's runtime: the shared session runtime
(:class:`~duplex_server.session.live.LiveSession`) with the Live adapter
(:class:`~duplex_server.protocol.live_adapter.LiveAdapter`) on its actions, the backend runs
of responses-mode delegations and the session's clock.

:func:`open_live` opens a session for a transport as the registry opens a Realtime one
(the same engine call, the same admission and ``max_sessions``, the same registry), then
sets the :class:`LiveRuntime` as the session's wire adapter: every batch of the core's
actions passes through the adapter before the session carries it out, and the runtime
does the adapter's own work (:class:`~duplex_server.protocol.live_delegation.RunBackend`:
a chat job on the engine, its items fed back to the adapter; ``StopBackends``). A ticker
gives the adapter the time every 100 ms (usage, expiry, lines waiting for the floor) until
the session ends; the runtime outlives its transports (a reconnect finds it as the
session's ``adapter``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Protocol

import msgspec

from duplex_contract.batch import BatchItem, BatchJob
from duplex_contract.control import OpenCall
from duplex_contract.errors import EngineError
from duplex_server.config import ServerConfig
from duplex_server.protocol.commands import Action
from duplex_server.protocol.errors import SessionFatal
from duplex_server.protocol.events import TurnDetection
from duplex_server.protocol.live_adapter import LiveAdapter
from duplex_server.protocol.live_config import LiveOptions, LiveStart, effective_session
from duplex_server.protocol.live_delegation import RunBackend, Step, StopBackends
from duplex_server.protocol.machine import SessionMachine
from duplex_server.protocol.session_config import SEMANTIC_MAX_WAIT_MS
from duplex_server.session import handshake
from duplex_server.session.attach import Attachment
from duplex_server.session.hub import Hub
from duplex_server.session.live import LiveSession, now_ms
from duplex_server.session.snapshot import Replica

log = logging.getLogger(__name__)

#: how often the adapter is given the time (the floor, usage, expiry)
TICK_S = 0.1


class ChatEngine(Protocol):
    """What a backend run needs of the engine: batch chat jobs
    (:class:`engine.api.client.EngineClient`)."""

    def generate(
        self, job: BatchJob, request_id: str | None = None
    ) -> AsyncIterator[BatchItem]: ...


def live_options(server: ServerConfig) -> LiveOptions:
    """The server's Live settings (``server.live``) as the adapter takes them."""
    cfg = server.live
    td = TurnDetection()
    if cfg.turn_detection == "semantic_vad":
        silence = SEMANTIC_MAX_WAIT_MS[cfg.eagerness]
        td = TurnDetection(
            type="semantic_vad", eagerness=cfg.eagerness, silence_duration_ms=silence
        )
    if cfg.silence_duration_ms is not None:
        td = msgspec.structs.replace(td, silence_duration_ms=cfg.silence_duration_ms)
    return LiveOptions(
        model_aliases=cfg.model_aliases,
        turn_detection=td,
        interruption=cfg.interruption,
        max_session_s=cfg.max_session_s,
        usage_interval_s=cfg.usage_interval_s,
        context_window_tokens=cfg.context_window_tokens,
        backend_route=cfg.backend_route,
        backend_max_output_tokens=cfg.backend_max_output_tokens,
        output_lead_ms=cfg.output_lead_ms,
    )


class LiveRuntime:
    """One Live session: its session runtime, adapter, backend runs and clock."""

    def __init__(self, session: LiveSession, adapter: LiveAdapter, chat: ChatEngine | None) -> None:
        self.session = session
        self.adapter = adapter
        self.chat = chat
        self._backends: dict[str, asyncio.Task[None]] = {}
        self._ticker: asyncio.Task[None] | None = None
        session.protocol = "live"
        session.stamper.seq_on_wire = False
        session.adapter = self

    @property
    def core(self) -> SessionMachine:
        return self.session.core

    # ------------------------------------------------------------------ WireAdapter
    def translate(self, actions: list[Action]) -> list[Action]:
        out, work = self.adapter.translate(actions, now_ms())
        for action in work:
            self._do(action)
        return out

    def state(self) -> bytes:
        return self.adapter.state()

    # ------------------------------------------------------------------ inputs
    def run(self, steps: list[Step]) -> None:
        """Carry out the adapter's steps: the core's actions through the session (and so
        through :meth:`translate`), then the runtime's own work."""
        actions = [s for s in steps if not isinstance(s, RunBackend | StopBackends)]
        if actions:
            self.session.apply(actions)
        for step in steps:
            if isinstance(step, RunBackend | StopBackends):
                self._do(step)

    def receive_text(self, text: str | bytes) -> None:
        self.run(self.adapter.on_text(text, now_ms()))

    def attached(self) -> None:
        """A transport is attached (opened, or a reconnect)."""
        self.adapter.attached = True
        self.run(self.adapter.pump(now_ms()))

    def dropped(self) -> None:
        """The transport went away without a close: the answer stops where its audio did."""
        self.run(self.adapter.dropped(now_ms()))

    # ------------------------------------------------------------------ the runtime's work
    def _do(self, action: RunBackend | StopBackends) -> None:
        if isinstance(action, StopBackends):
            for task in self._backends.values():
                task.cancel()
            self._backends.clear()
            return
        old = self._backends.pop(action.delegation_id, None)
        if old is not None:
            old.cancel()
        task = asyncio.create_task(
            self._backend(action), name=f"live-backend:{action.delegation_id}"
        )
        self._backends[action.delegation_id] = task
        task.add_done_callback(lambda t: self._ended(action.delegation_id, t))

    def _ended(self, delegation_id: str, task: asyncio.Task[None]) -> None:
        if self._backends.get(delegation_id) is task:
            del self._backends[delegation_id]

    async def _backend(self, action: RunBackend) -> None:
        did = action.delegation_id
        if self.chat is None:
            self.run(self.adapter.backend_failed(did, "engine_unavailable", "no engine", now_ms()))
            return
        try:
            async for item in self.chat.generate(action.job):
                self.run(self.adapter.on_backend(did, item, now_ms()))
        except EngineError as exc:
            log.info("%s: delegation %s backend failed: %s", self.core.session_id, did, exc)
            self.run(self.adapter.backend_failed(did, exc.code, exc.message, now_ms()))
        except Exception as exc:  # a bug: the delegation fails, the session goes on
            log.exception("%s: delegation %s backend broke", self.core.session_id, did)
            self.run(self.adapter.backend_failed(did, "server_error", type(exc).__name__, now_ms()))

    def start(self, hub: Hub) -> None:
        self._ticker = asyncio.create_task(self._tick(hub), name=f"live:{self.core.session_id}")

    async def _tick(self, hub: Hub) -> None:
        sid = self.core.session_id
        try:
            while hub.sessions.live.get(sid) is self.session:
                await asyncio.sleep(TICK_S)
                self.run(self.adapter.tick(now_ms(), time.time()))
        finally:
            self._do(StopBackends())
            self.session.adapter = None  # no cycle keeps an ended session

    async def stop(self) -> None:
        """Cancel the ticker (tests, shutdown)."""
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker


def adopt_live(
    session: LiveSession, rep: Replica, options: LiveOptions, chat: ChatEngine | None
) -> LiveRuntime:
    """A Live session taken over from a front end that is gone (``Sessions.adopt``'s
    ``prepare``): its adapter rebuilt from the replica. Raises :class:`SessionFatal` if
    the session is not a Live one (or its replica is unreadable)."""
    try:
        adapter = LiveAdapter.restore(
            session.core, rep.wire, options, now_ms=now_ms(), unix_s=time.time()
        )
    except (msgspec.DecodeError, msgspec.ValidationError):
        sid = session.core.session_id
        raise SessionFatal("session_not_found", f"no live Live session {sid}") from None
    return LiveRuntime(session, adapter, chat)


async def open_live(
    hub: Hub,
    attachment: Attachment,
    start: LiveStart,
    options: LiveOptions,
    chat: ChatEngine | None,
) -> LiveRuntime:
    """A new Live session for ``attachment``, on the shared core and registry. Raises
    :class:`~duplex_server.protocol.errors.ProtocolError` or an engine error if refused
    (``resource_exhausted`` at ``max_sessions``, as on every route)."""
    handshake.require_engine(hub)
    sessions = hub.sessions
    engine = sessions.engine
    assert engine is not None
    cfg = effective_session(start, sessions.template(), options)
    trace = sessions.tracing.session(sessions.route_key) if sessions.tracing is not None else None
    try:
        res = await engine.call(
            OpenCall(
                cfg.settings(),
                route_key=sessions.route_key,
                traceparent=trace.traceparent if trace is not None else None,
            )
        )
    except BaseException as exc:
        if trace is not None:
            trace.refused(exc)
        raise
    assert res.session_id is not None
    core = SessionMachine(res.session_id, cfg, lease_generation=res.lease_generation)
    if trace is not None:
        trace.opened(res.session_id)
    session = LiveSession(
        engine, core, sessions.limits, sessions.inputs, sessions.metrics, trace=trace
    )
    adapter = LiveAdapter(core, start, options, now_ms=now_ms(), unix_s=time.time())
    runtime = LiveRuntime(session, adapter, chat)
    sessions.start(session)
    await session.open(attachment, hub.capabilities())
    runtime.start(hub)
    return runtime
