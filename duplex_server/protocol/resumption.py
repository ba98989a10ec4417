"""A session's resumption (pure): its resume token, the resume handshake and what a new
transport is told when it opens, resumes or takes the session over.

:class:`Resumption` keeps the digest of the current resume token (never the token), whether
a resume is waiting for the engine, and the token a resume hands out. The session machine
(:mod:`~duplex_server.protocol.machine`) calls it with what it owns (the configuration, the
lease generation, the client input numbering) and applies what it decides.
"""

from __future__ import annotations

from duplex_contract.fence import resume_query
from duplex_server.protocol import events as ev
from duplex_server.protocol.commands import (
    Action,
    Replay,
    Send,
    SendStamped,
    Takeover,
    configure_input,
)
from duplex_server.protocol.errors import SessionFatal
from duplex_server.protocol.resume import token_matches
from duplex_server.protocol.session_config import EffectiveSession


class Resumption:
    """Open, resume (token check, journal replay) and takeover of one session."""

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self.token_hash = b""  # digest of the current resume token
        self.resuming = False  # a resume is waiting for the engine
        self._new_token = ""  # the token the resume in progress hands out

    def opened(
        self,
        config: EffectiveSession,
        resume_token: str,
        capabilities: ev.Capabilities,
        token_hash: bytes,
    ) -> list[Action]:
        """The session was opened for its first transport."""
        self.token_hash = token_hash
        created = ev.SessionCreated(
            session=config.to_wire(self.session_id),
            resume_token=resume_token,
            capabilities=capabilities,
            resume_query=resume_query(self.session_id),
        )
        return [Send(created), configure_input(config)]

    def admit(self, token: str, *, closed: bool) -> None:
        """May a new transport resume this session? Raises :class:`SessionFatal` if not;
        else the session is resuming until :meth:`resumed` or :meth:`resume_failed`."""
        if closed:
            raise SessionFatal("session_not_found", f"no live session {self.session_id}")
        if not token_matches(token, self.token_hash):
            raise SessionFatal("invalid_resume_token", "the resume token does not match")
        if self.resuming:
            raise SessionFatal("stale_lease", "another resume of this session is in progress")
        self.resuming = True

    def resume_failed(self) -> None:
        self.resuming = False

    def resumed(
        self, token: str, token_hash: bytes, *, after_seq: int, attached: bool
    ) -> list[Action]:
        """The engine renewed the lease: the new transport takes over (the old one, if
        ``attached``, is replaced) and is sent what it missed after ``after_seq``."""
        self.resuming = False
        self.token_hash = token_hash
        self._new_token = token
        return [*([Takeover()] if attached else []), Replay(after_seq)]

    def replayed(
        self,
        frames: list[bytes] | None,
        first_available: int,
        last_seq: int,
        *,
        lease_generation: int,
        last_input_seq: int,
    ) -> list[Action]:
        """What the journal had after the resume point (``None``: some of it was lost)."""
        out: list[Action] = []
        if frames is None:
            reason = "events after the given seq are no longer journaled"
            resync = ev.ResyncRequired(
                reason=reason, first_available_seq=first_available, last_seq=last_seq
            )
            out.append(Send(resync))
        elif frames:
            out.append(SendStamped(tuple(frames)))
        resumed = ev.SessionResumed(
            session_id=self.session_id,
            resume_token=self._new_token,
            replayed=0 if frames is None else len(frames),
            lease_generation=lease_generation,
            last_input_seq=last_input_seq,
        )
        out.append(Send(resumed))
        return out

    def taken_over(
        self,
        config: EffectiveSession,
        token: str,
        *,
        last_seq: int,
        lost: bool,
        lease_generation: int,
        last_input_seq: int,
    ) -> list[Action]:
        """What the client is told when this front end took the session over. ``lost``: the
        old front end may have produced events after the client's last one that nobody kept
        (a crash): the client must re-read what it needs (``session.resync_required``,
        docs/scale.md)."""
        out: list[Action] = [configure_input(config)]
        if lost:
            resync = ev.ResyncRequired(
                reason="front_end_lost", first_available_seq=last_seq + 1, last_seq=last_seq
            )
            out.append(Send(resync))
        resumed = ev.SessionResumed(
            session_id=self.session_id,
            resume_token=token,
            replayed=0,
            lease_generation=lease_generation,
            last_input_seq=last_input_seq,
        )
        out.append(Send(resumed))
        return out
