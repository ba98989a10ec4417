"""The control plane's session table: the sessions (each with its lease), the tombstones of
ended ones and the admissions count.

The orchestrator thread is its only writer; :meth:`SessionTable.counts` (metrics) may run on
another thread, so every insert and removal holds :attr:`SessionTable.lock`, as ``counts``
does.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator

from duplex_contract.errors import ControlError
from engine.duplex.session import DuplexSession

#: ended sessions remembered (a late call to one says "has ended", not "unknown")
TOMBSTONES = 100_000
#: open calls remembered by their operation_id (a retried open opens one session)
OPENED = 4096


class SessionTable:
    """The sessions by id, at most ``max_sessions`` of them."""

    def __init__(self, max_sessions: int) -> None:
        self.max_sessions = max_sessions
        #: every session not yet finished (open or closing)
        self.sessions: dict[str, DuplexSession] = {}
        #: held by every insert into and removal from ``sessions`` and by ``counts``
        self.lock = threading.Lock()
        self.tombstones: OrderedDict[str, str] = OrderedDict()  # session id -> why it ended
        self.admissions = {"accepted": 0, "rejected": 0}
        self.opened: OrderedDict[str, str] = OrderedDict()  # open operation_id -> session id

    def remember_open(self, op_id: str, session_id: str) -> None:
        self.opened[op_id] = session_id
        while len(self.opened) > OPENED:
            self.opened.popitem(last=False)

    def reserve(self) -> None:
        """Room for one more session, or ``resource_exhausted`` (counted as a rejection)."""
        if len(self.sessions) >= self.max_sessions:
            self.admissions["rejected"] += 1
            raise ControlError(
                f"server is at capacity ({self.max_sessions} sessions)", code="resource_exhausted"
            )

    def add(self, session: DuplexSession) -> None:
        with self.lock:
            self.sessions[session.session_id] = session
        self.admissions["accepted"] += 1

    def get(self, session_id: str) -> DuplexSession | None:
        """The session, open or closing; None if unknown or finished."""
        return self.sessions.get(session_id)

    def lookup(self, session_id: str) -> DuplexSession:
        """The open session, or ``not_found`` / ``session_expired``."""
        session = self.sessions.get(session_id)
        if session is None:
            reason = self.tombstones.get(session_id)
            if reason is not None:
                raise ControlError(
                    f"session {session_id} has ended ({reason})", code="session_expired"
                )
            raise ControlError(f"unknown session {session_id}", code="not_found")
        if session.state != "open":
            raise ControlError(
                f"session {session_id} is closing ({session.close_reason})",
                code="session_expired",
            )
        return session

    def ended(self, session_id: str) -> bool:
        """Did this session exist and finish?"""
        return session_id in self.tombstones

    def remove(self, session_id: str) -> DuplexSession | None:
        """Finish a session: out of the table, its close reason kept as a tombstone."""
        with self.lock:
            session = self.sessions.pop(session_id, None)
        if session is None:
            return None
        session.state = "closed"
        self.tombstones[session_id] = session.close_reason
        while len(self.tombstones) > TOMBSTONES:
            self.tombstones.popitem(last=False)
        return session

    def counts(self) -> dict[str, int]:
        """Sessions by state; safe to call from another thread (metrics)."""
        out = {"open": 0, "detached": 0, "closing": 0}
        with self.lock:
            sessions = list(self.sessions.values())
        for s in sessions:
            if s.state == "closing":
                out["closing"] += 1
            elif s.lease.detached_at is not None:
                out["detached"] += 1
            else:
                out["open"] += 1
        return out

    def __iter__(self) -> Iterator[DuplexSession]:
        """A snapshot of the sessions (the caller may close some as it goes)."""
        return iter(list(self.sessions.values()))

    def __len__(self) -> int:
        return len(self.sessions)
