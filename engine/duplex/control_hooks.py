"""What the orchestrator calls besides control calls: the turn queue, the lease reaper,
detaching a session whose front end is gone, and the counts for metrics."""

from __future__ import annotations

from duplex_contract.events import SessionLifecycle
from duplex_contract.fence import Fence
from engine.duplex.control_core import ControlCore
from engine.duplex.effects import Effects
from engine.duplex.session import TurnJob
from engine.messages import SessionOutput


class ControlHooks(ControlCore):
    """The orchestrator's hooks into the control plane (:class:`ControlCore` underneath)."""

    # ------------------------------------------------------------------ orchestrator hooks
    def next_job(self, session_id: str) -> TurnJob | None:
        session = self.sessions.get(session_id)
        if session is None or session.state != "open" or session.active is not None:
            return None
        if not session.jobs:
            return None
        session.active = session.jobs.popleft()
        return session.active

    def job_done(self, session_id: str, job: TurnJob, now: float) -> None:
        session = self.sessions.get(session_id)
        if session is None or session.active is not job:
            return  # cancelled or closed meanwhile: already accounted for
        session.active = None
        session.lease.activity(now)

    def is_current(self, fence: Fence) -> bool:
        """May output tagged with ``fence`` still be delivered?"""
        session = self.sessions.get(fence.session_id)
        return (
            session is not None and session.state == "open" and fence.epoch == session.fence.epoch
        )

    def tick(self, now: float, cleaning: set[str]) -> Effects:
        """Reaper: warn, expire, and retry cleanups that are not running."""
        effects = Effects()
        cfg = self.config
        for session in list(self.sessions.values()):
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
                self._begin_close(session, reason, effects)
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

    def detach(self, session_id: str, now: float) -> bool:
        """Detach a session whose front end is gone (no fence: nobody is left to hold one).
        Returns False for an unknown or closing session."""
        session = self.sessions.get(session_id)
        if session is None or session.state != "open":
            return False
        session.lease.detach(now)
        return True

    def counts(self) -> dict[str, int]:
        """Sessions by state; safe to call from another thread (metrics)."""
        out = {"open": 0, "detached": 0, "closing": 0}
        with self.table_lock:
            sessions = list(self.sessions.values())
        for s in sessions:
            if s.state == "closing":
                out["closing"] += 1
            elif s.lease.detached_at is not None:
                out["detached"] += 1
            else:
                out["open"] += 1
        return out
