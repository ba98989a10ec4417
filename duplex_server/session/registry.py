"""The live sessions of one front end: opens and resumes sessions for any transport, each
in its own task group (:class:`Sessions`)."""

from __future__ import annotations

import asyncio
import logging

from duplex_contract.audio import OUTPUT_RATE
from duplex_contract.control import OpenCall
from duplex_contract.voices import VoiceCatalog
from duplex_server.ops.metrics import Metrics
from duplex_server.ops.tracing import Tracing
from duplex_server.protocol import events as ev
from duplex_server.protocol.config import EffectiveSession
from duplex_server.protocol.machine import SessionMachine
from duplex_server.session.adopt import adopt
from duplex_server.session.attach import Attachment
from duplex_server.session.engine_calls import EngineSessions
from duplex_server.session.input_lane import InputScheduler
from duplex_server.session.live import LiveSession, SessionLimits

log = logging.getLogger(__name__)


class Sessions:
    """The live sessions of one app, for any transport; each runs its own task group."""

    def __init__(
        self,
        limits: SessionLimits,
        inputs: InputScheduler,
        metrics: Metrics,
        *,
        instructions: str,
        model: str,
        output_rate: int = OUTPUT_RATE,
        route_key: str | None = None,
        voices: VoiceCatalog | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.limits = limits
        self.tracing = tracing  # one trace per session (server.otel), or None
        self.route_key = route_key  # this front end's: session ids carry it
        self.inputs = inputs
        self.metrics = metrics
        self.instructions = instructions
        self.model = model
        self.output_rate = output_rate
        self.voices = voices  # checked by session.update (None: any name)
        self.engine: EngineSessions | None = None
        self.live: dict[str, LiveSession] = {}
        self._runs: dict[str, asyncio.Task[None]] = {}

    def __len__(self) -> int:
        return len(self.live)

    def by_state(self) -> dict[str, int]:
        """Live sessions by state: ``attached`` (a transport), ``detached`` (none; the
        engine ends it after ``disconnect_grace_s`` unless it resumes), ``closing`` (ended,
        its engine session not yet gone)."""
        out = {"attached": 0, "detached": 0, "closing": 0}
        for s in self.live.values():
            state = "closing" if s.core.closed else "attached" if s.attachment else "detached"
            out[state] += 1
        return out

    def held_bytes(self) -> dict[str, int]:
        """Bytes the front end holds for its sessions: the journals, and input audio not yet
        handed to the engine (the input lanes' backlog and queued appends)."""
        journal = sum(s.journal.bytes for s in self.live.values())
        pending = sum(s.input_bytes for s in self.live.values())
        return {"journal": journal, "input": pending}

    async def open(
        self, attachment: Attachment, capabilities: ev.Capabilities, *, beta: bool
    ) -> LiveSession:
        engine = self.engine
        assert engine is not None
        cfg = EffectiveSession(
            instructions=self.instructions,
            event_names="beta" if beta else "ga",
            model=self.model,
            output_rate=self.output_rate,
            voices=self.voices,
        )
        trace = self.tracing.session(self.route_key) if self.tracing is not None else None
        try:
            res = await engine.call(
                OpenCall(
                    cfg.settings(),
                    route_key=self.route_key,
                    traceparent=trace.traceparent if trace is not None else None,
                )
            )
        except BaseException as exc:
            if trace is not None:
                trace.refused(exc)
            raise
        assert res.session_id is not None
        core = SessionMachine(res.session_id, cfg, lease_generation=res.lease_generation)
        session = LiveSession(engine, core, self.limits, self.inputs, self.metrics)
        if trace is not None:
            trace.opened(session.session_id)
            session.trace = trace
        self.start(session)
        await session.open(attachment, capabilities)
        return session

    def start(self, session: LiveSession) -> None:
        """Register ``session`` and run its tasks (a new one, or one taken over)."""
        self.live[session.session_id] = session
        task = asyncio.create_task(self._run(session), name=f"session:{session.session_id}")
        self._runs[session.session_id] = task

    def template(self) -> EffectiveSession:
        """A new session's configuration on this front end (before any session.update)."""
        return EffectiveSession(
            instructions=self.instructions,
            model=self.model,
            output_rate=self.output_rate,
            voices=self.voices,
        )

    async def resume(self, attachment: Attachment, req: ev.SessionResume) -> LiveSession:
        """Resume a session of this front end, or take over one whose front end is gone
        (or draining) through the engine (:mod:`duplex_server.session.adopt`)."""
        session = self.live.get(req.session_id)
        if session is None:
            return await adopt(self, attachment, req)
        await session.resume(attachment, req)
        return session

    async def _run(self, session: LiveSession) -> None:
        try:
            await session.run()
        except Exception:
            log.exception("%s: session tasks failed", session.session_id)
        finally:
            if session.trace is not None:
                session.trace.end()
            self.live.pop(session.session_id, None)
            self._runs.pop(session.session_id, None)

    async def shutdown(self, grace_s: float) -> None:
        runs = list(self._runs.values())
        for task in runs:
            task.cancel()
        if runs:
            await asyncio.wait(runs, timeout=grace_s)
