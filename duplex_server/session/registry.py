"""The live sessions of one front end: opens, resumes and takes over sessions for any
transport, each in its own task group (:class:`Sessions`).

Taking a session over from a front end that is gone (a crash) or draining (a deploy)
(:meth:`Sessions.resume` of a session this front end does not hold): the engine has the
session (lease, fence, conversation) and the old owner's replica
(duplex_server/session/snapshot.py). This front end peeks at both, checks the resume token
against the replica, renews the lease with the usual compare and swap (of two front ends
racing for one session, one wins; ``stale_lease`` for the other), rebuilds the session core
at the engine's position with the conversation items (and usage) the engine kept for it,
keeps a replica of its own (the new token) and tells the client:
``session.resync_required`` when events may have been lost with the old process, then
``session.resumed``. From then on the engine sends the session's events here.
docs/scale.md describes what can be lost.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import msgspec

from duplex_contract.audio import OUTPUT_RATE
from duplex_contract.control import ControlResult, OpenCall, ResumeCall
from duplex_contract.errors import ControlError
from duplex_contract.voices import VoiceCatalog
from duplex_server.ops.metrics import Metrics
from duplex_server.ops.tracing import Tracing
from duplex_server.protocol import events as ev
from duplex_server.protocol.errors import SessionFatal
from duplex_server.protocol.machine import SessionMachine
from duplex_server.protocol.resume import new_resume_token, token_matches
from duplex_server.protocol.session_config import EffectiveSession
from duplex_server.session.attach import Attachment
from duplex_server.session.engine_calls import EngineSessions, operation_id
from duplex_server.session.input_lane import InputScheduler
from duplex_server.session.live import LiveSession, SessionLimits
from duplex_server.session.snapshot import Replica, decode, restore_items

log = logging.getLogger(__name__)

#: sets up a taken-over session's wire from its replica (``Sessions.adopt``)
Prepare = Callable[[LiveSession, Replica], None]


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

    def by_protocol(self) -> dict[str, int]:
        """Live sessions by wire protocol: ``realtime`` (the Realtime wire, on any
        transport) and ``live`` (GPT-Live)."""
        out = {"realtime": 0, "live": 0}
        for s in self.live.values():
            out[s.protocol] = out.get(s.protocol, 0) + 1
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
                    operation_id=operation_id(),
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
        session = LiveSession(engine, core, self.limits, self.inputs, self.metrics, trace=trace)
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

    async def resume(
        self, attachment: Attachment, req: ev.SessionResume, *, prepare: Prepare | None = None
    ) -> LiveSession:
        """Resume a session of this front end, or take over one whose front end is gone
        (or draining) through the engine (:meth:`adopt`)."""
        session = self.live.get(req.session_id)
        if session is None:
            return await self.adopt(attachment, req, prepare=prepare)
        await session.resume(attachment, req)
        return session

    async def adopt(
        self, attachment: Attachment, req: ev.SessionResume, *, prepare: Prepare | None = None
    ) -> LiveSession:
        """Take over the session ``req`` names from the front end that held it. Raises
        :class:`SessionFatal` (or an engine error) when the session cannot be taken.
        ``prepare``: sets up the session's wire (a GPT-Live adapter) from the replica before
        anything is sent; it raises :class:`SessionFatal` to refuse the session."""
        engine = self.engine
        assert engine is not None
        sid = req.session_id
        rep, peek = await self._replica(req)
        # the compare and swap
        res = await engine.call(ResumeCall(sid, peek.lease_generation, operation_id=operation_id()))
        assert res.accepted_fence is not None
        core = SessionMachine(sid, rep.config, lease_generation=res.lease_generation)
        token, digest = new_resume_token()
        core.adopted(res.accepted_fence, res.input_seq or 0, digest)
        restore_items(core, peek.items or (), peek.items_state or b"")
        client_seq = req.last_received_server_event_seq
        last = max(client_seq, rep.event_seq)  # numbering goes on after anything it could have
        session = LiveSession(engine, core, self.limits, self.inputs, self.metrics, event_seq=last)
        if prepare is not None:
            prepare(session, rep)
        self.start(session)
        await session.replicate()  # the new token, before the client holds it
        lost = not (rep.handed_over and client_seq >= rep.event_seq)
        session.adopted(attachment, core.taken_over(token, last_seq=last, lost=lost))
        self.metrics.sessions_taken_over.labels("crash" if lost else "handover").inc()
        log.info(
            "%s: taken over (lease %d, %s)", sid, res.lease_generation, "lost" if lost else "clean"
        )
        return session

    async def _replica(self, req: ev.SessionResume) -> tuple[Replica, ControlResult]:
        """The replica of the session ``req`` names, checked against its resume token, and
        what the engine has of it now (a peek: nothing changes in the engine)."""
        engine = self.engine
        assert engine is not None
        sid = req.session_id
        not_found = SessionFatal("session_not_found", f"no live session {sid}")
        try:
            peek = await engine.call(ResumeCall(sid, 0, peek=True, operation_id=operation_id()))
        except ControlError as exc:
            if exc.code in ("not_found", "session_expired"):
                raise not_found from None
            raise
        if not peek.replica:
            raise not_found  # its front end kept no replica (an older one): it cannot move
        try:
            rep = decode(peek.replica, self.template())
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("%s: unreadable replica: %s", sid, exc)
            raise not_found from None
        if not token_matches(req.resume_token, rep.token_hash):
            raise SessionFatal("invalid_resume_token", "the resume token does not match")
        return rep, peek

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
