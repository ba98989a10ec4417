"""A session's life in the control plane: open, resume (a new lease generation), detach,
expiry (the lease reaper), close, and its end once the orchestrator has aborted its work."""

from __future__ import annotations

from duplex_contract.control import CloseCall, ControlResult, OpenCall, ResumeCall
from duplex_contract.errors import ControlError
from duplex_contract.session_events import SessionLifecycle
from engine.config import DuplexRuntimeConfig
from engine.duplex import replica
from engine.duplex.effects import Effects
from engine.duplex.epochs import begin_close
from engine.duplex.fencing import ROUTE_KEY, check_fresh, initial_fence, new_session_id
from engine.duplex.lease import Lease
from engine.duplex.session import DuplexSession
from engine.duplex.table import SessionTable
from engine.messages import SessionOutput
from engine.orchestration.history import ConversationHistory


class Lifecycle:
    """Opens, resumes, closes and expires the sessions of one :class:`SessionTable`."""

    def __init__(self, config: DuplexRuntimeConfig, table: SessionTable) -> None:
        self.config = config
        self.table = table

    def open(self, call: OpenCall, control_id: int, now: float) -> ControlResult:
        self.table.reserve()
        cfg = call.config
        if cfg.output_sample_rate < 8000 or cfg.output_sample_rate > 48000:
            raise ControlError(
                "output_sample_rate must be within 8000..48000", code="invalid_argument"
            )
        if call.route_key is not None and not ROUTE_KEY.match(call.route_key):
            raise ControlError("route_key must be 1-16 of a-z and 0-9", code="invalid_argument")
        sid = new_session_id(call.route_key)
        session = DuplexSession(
            session_id=sid,
            config=cfg,
            fence=initial_fence(sid),
            lease=Lease(created_at=now, last_activity=now),
            history=ConversationHistory(self.config.history_budget_chars),
        )
        self.table.add(session)
        return session.ok(control_id)

    def resume(self, call: ResumeCall, control_id: int, now: float) -> ControlResult:
        """Renew the lease (compare and swap on its generation); ``peek`` changes nothing;
        ``reattach`` (the owner, after an engine restart) keeps the generation."""
        session = self.table.lookup(call.session_id)
        if call.peek:
            return replica.peek(session, control_id)
        if call.expected_lease_generation != session.lease.generation:
            raise ControlError(
                f"lease generation {call.expected_lease_generation} is not current "
                f"({session.lease.generation})",
                code="stale_lease",
            )
        if call.reattach:
            session.lease.attach(now)
            return session.ok(control_id, input_seq=session.last_seq)
        session.lease.generation += 1
        session.lease.attach(now)
        return session.ok(control_id, input_seq=session.last_seq)

    def close(self, call: CloseCall, control_id: int, effects: Effects) -> ControlResult:
        """The first step of an idempotent close (the orchestrator's clean-up finishes it)."""
        sid = call.fence.session_id
        session = self.table.get(sid)
        if session is None:
            if self.table.ended(sid):  # idempotent
                return ControlResult(control_id=control_id, ok=True, session_id=sid)
            raise ControlError(f"unknown session {sid}", code="not_found")
        if call.lease_generation != session.lease.generation:
            raise ControlError(
                "close from a replaced attachment; the session stays open", code="stale_fence"
            )
        if session.state != "open":
            return session.ok(control_id)
        check_fresh(call.fence, session.fence)
        begin_close(session, call.reason, effects)
        return session.ok(control_id)

    def finish_close(self, session_id: str) -> Effects:
        """The orchestrator finished aborting this session's work: free the slot."""
        effects = Effects()
        session = self.table.remove(session_id)
        if session is None:
            return effects
        effects.events.append(
            SessionOutput(
                session_id=session_id,
                event=SessionLifecycle(
                    session_id=session_id, state="closed", reason=session.close_reason
                ),
            )
        )
        return effects

    def detach(self, session_id: str, now: float) -> bool:
        """Detach a session whose front end is gone (no fence: nobody is left to hold one).
        Returns False for an unknown or closing session."""
        session = self.table.get(session_id)
        if session is None or session.state != "open":
            return False
        session.lease.detach(now)
        return True

    def tick(self, now: float, cleaning: set[str]) -> Effects:
        """The lease reaper: warn, expire, and retry cleanups that are not running."""
        effects = Effects()
        cfg = self.config
        for session in self.table:
            sid = session.session_id
            if session.state == "closing":
                if sid not in cleaning:
                    effects.cleanups.append(sid)
                continue
            due = session.lease.deadline(cfg, busy=session.pending_turns() > 0)
            if due is None:
                continue
            deadline, reason = due
            if now >= deadline:
                effects.events.append(
                    SessionOutput(
                        session_id=sid,
                        event=SessionLifecycle(session_id=sid, state="expired", reason=reason),
                    )
                )
                begin_close(session, reason, effects)
            elif deadline - now <= cfg.expiring_warning_s and session.lease.warned_for != deadline:
                session.lease.warned_for = deadline
                effects.events.append(
                    SessionOutput(
                        session_id=sid,
                        event=SessionLifecycle(
                            session_id=sid,
                            state="expiring",
                            reason=reason,
                            in_s=round(deadline - now, 3),
                        ),
                    )
                )
        return effects
