"""The control plane's session table and its lifecycle: open, resume, close.

:class:`ControlCore` holds the state every layer of :class:`engine.duplex.control.DuplexControl`
uses (the session table, its lock, the tombstones of ended sessions, the admissions) and the
helpers they share: the OK result, the session lookup, and dropping a session's work.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from duplex_contract.control import CloseCall, ControlResult, OpenCall, ResumeCall
from duplex_contract.errors import ControlError
from duplex_contract.events import SessionLifecycle
from engine.config import DuplexRuntimeConfig
from engine.duplex import replica
from engine.duplex.effects import Cancel, Effects
from engine.duplex.fence import ROUTE_KEY, initial_fence, new_session_id
from engine.duplex.lease import Lease
from engine.duplex.session import DuplexSession
from engine.messages import SessionOutput
from engine.orchestration.history import ConversationHistory

_TOMBSTONES = 100_000


def _err(code: str, message: str) -> ControlError:
    return ControlError(message, code=code)


class ControlCore:
    """The session table; sessions open, resume and close here (the first of the layers:
    :mod:`engine.duplex.control_hooks`, :mod:`engine.duplex.control_epochs`,
    :mod:`engine.duplex.control_input`, then :class:`engine.duplex.control.DuplexControl`)."""

    def __init__(self, config: DuplexRuntimeConfig, default_instructions: str = "") -> None:
        self.config = config
        self.default_instructions = default_instructions
        self.sessions: dict[str, DuplexSession] = {}
        #: held by every insert into and removal from ``sessions`` and by ``counts``
        self.table_lock = threading.Lock()
        self.tombstones: OrderedDict[str, str] = OrderedDict()
        self.admissions = {"accepted": 0, "rejected": 0}

    def _ok(self, control_id: int, session: DuplexSession, **extra: object) -> ControlResult:
        return ControlResult(
            control_id=control_id,
            ok=True,
            session_id=session.session_id,
            accepted_fence=session.fence,
            lease_generation=session.lease.generation,
            **extra,  # type: ignore[arg-type]
        )

    def _lookup(self, session_id: str) -> DuplexSession:
        session = self.sessions.get(session_id)
        if session is None:
            reason = self.tombstones.get(session_id)
            if reason is not None:
                raise _err("session_expired", f"session {session_id} has ended ({reason})")
            raise _err("not_found", f"unknown session {session_id}")
        if session.state != "open":
            raise _err(
                "session_expired", f"session {session_id} is closing ({session.close_reason})"
            )
        return session

    # ------------------------------------------------------------------ open / resume / close
    def _open(self, call: OpenCall, control_id: int, now: float) -> ControlResult:
        if len(self.sessions) >= self.config.max_sessions:
            self.admissions["rejected"] += 1
            raise _err(
                "resource_exhausted", f"server is at capacity ({self.config.max_sessions} sessions)"
            )
        cfg = call.config
        if cfg.output_sample_rate < 8000 or cfg.output_sample_rate > 48000:
            raise _err("invalid_argument", "output_sample_rate must be within 8000..48000")
        if call.route_key is not None and not ROUTE_KEY.match(call.route_key):
            raise _err("invalid_argument", "route_key must be 1-16 of a-z and 0-9")
        sid = new_session_id(call.route_key)
        session = DuplexSession(
            session_id=sid,
            config=cfg,
            fence=initial_fence(sid),
            lease=Lease(created_at=now, last_activity=now),
            history=ConversationHistory(self.config.history_budget_chars),
        )
        with self.table_lock:
            self.sessions[sid] = session
        self.admissions["accepted"] += 1
        return self._ok(control_id, session)

    def _resume(self, call: ResumeCall, control_id: int, now: float) -> ControlResult:
        session = self._lookup(call.session_id)
        if call.peek:
            return replica.peek(self, session, control_id)
        if call.expected_lease_generation != session.lease.generation:
            raise _err(
                "stale_lease",
                f"lease generation {call.expected_lease_generation} is not current "
                f"({session.lease.generation})",
            )
        session.lease.generation += 1
        session.lease.attach(now)
        return self._ok(control_id, session, input_seq=session.last_seq)

    def _close(
        self, call: CloseCall, control_id: int, now: float, effects: Effects
    ) -> ControlResult:
        sid = call.fence.session_id
        session = self.sessions.get(sid)
        if session is None:
            if sid in self.tombstones:  # idempotent
                return ControlResult(control_id=control_id, ok=True, session_id=sid)
            raise _err("not_found", f"unknown session {sid}")
        if call.lease_generation != session.lease.generation:
            raise _err("stale_fence", "close from a replaced attachment; the session stays open")
        if session.state != "open":
            return self._ok(control_id, session)
        if call.fence.is_stale_against(session.fence):
            raise _err(
                "stale_fence", f"stale fence {call.fence.key()} (current {session.fence.key()})"
            )
        self._begin_close(session, call.reason, effects)
        return self._ok(control_id, session)

    def _begin_close(self, session: DuplexSession, reason: str, effects: Effects) -> None:
        session.state = "closing"
        session.close_reason = reason
        effects.cancels.append(self._drop_work(session, reason))
        effects.cleanups.append(session.session_id)

    def finish_close(self, session_id: str) -> Effects:
        """The orchestrator finished aborting this session's work: free the slot."""
        effects = Effects()
        with self.table_lock:
            session = self.sessions.pop(session_id, None)
        if session is None:
            return effects
        session.state = "closed"
        self.tombstones[session_id] = session.close_reason
        while len(self.tombstones) > _TOMBSTONES:
            self.tombstones.popitem(last=False)
        effects.events.append(
            SessionOutput(
                session_id=session_id,
                event=SessionLifecycle(
                    session_id=session_id, state="closed", reason=session.close_reason
                ),
            )
        )
        return effects

    def _drop_work(self, session: DuplexSession, reason: str, epoch: int | None = None) -> Cancel:
        """Drop queued jobs and detach the active one; the caller aborts their stage work."""
        active = session.active
        session.jobs.clear()
        session.active = None
        if active is not None and active.respond:
            key = (active.fence.turn_id, active.fence.response_seq)
            played = session.played.get(key)
            if played is not None:
                try:
                    session.history.truncate(key[0], key[1], played)
                except KeyError:
                    pass  # the response had produced nothing yet
        return Cancel(
            session.session_id, session.fence.epoch if epoch is None else epoch, active, reason
        )
