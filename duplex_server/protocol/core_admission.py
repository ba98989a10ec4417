"""The session core's admission and resume: opening, resuming, taking over and ending a
session for a client that cannot keep up (sans-I/O, like the rest of the core)."""

from __future__ import annotations

from duplex_contract.fence import Fence, resume_query
from duplex_server.protocol import events as ev
from duplex_server.protocol.commands import (
    Action,
    CloseSocket,
    ConfigureInput,
    DropOutput,
    Release,
    Replay,
    Send,
    SendStamped,
    Takeover,
)
from duplex_server.protocol.core_state import CoreState
from duplex_server.protocol.errors import CloseCode, ProtocolError, SessionFatal
from duplex_server.protocol.resume import token_matches


class Admission(CoreState):
    """Open, resume (token check, lease renewal, journal replay) and slow-client decisions."""

    # ------------------------------------------------------------------ attachments
    def opened(
        self, resume_token: str, capabilities: ev.Capabilities, *, token_hash: bytes = b""
    ) -> list[Action]:
        """The session was opened for its first transport."""
        self.token_hash = token_hash
        return [
            Send(
                ev.SessionCreated(
                    session=self.config.to_wire(self.session_id),
                    resume_token=resume_token,
                    capabilities=capabilities,
                    resume_query=resume_query(self.session_id),
                )
            ),
            ConfigureInput(
                self.config.input_format, self.config.turn_detection, self.config.noise_reduction
            ),
        ]

    def admit_resume(self, token: str) -> None:
        """May a new transport resume this session? Raises :class:`SessionFatal` if not;
        else the session is resuming until :meth:`resumed` or :meth:`resume_failed`."""
        if self.closed:
            raise SessionFatal("session_not_found", f"no live session {self.session_id}")
        if not token_matches(token, self.token_hash):
            raise SessionFatal("invalid_resume_token", "the resume token does not match")
        if self.resuming:
            raise SessionFatal("stale_lease", "another resume of this session is in progress")
        self.resuming = True

    def resume_failed(self) -> None:
        self.resuming = False

    def resumed(
        self,
        lease_generation: int,
        token: str,
        token_hash: bytes,
        *,
        after_seq: int,
        attached: bool,
    ) -> list[Action]:
        """The engine renewed the lease: the new transport takes over (the old one, if
        ``attached``, is replaced) and is sent what it missed after ``after_seq``."""
        self.resuming = False
        self.lease_generation = lease_generation
        self.token_hash = token_hash
        self._new_token = token
        return [*([Takeover()] if attached else []), Replay(after_seq)]

    def replayed(
        self, frames: list[bytes] | None, first_available: int, last_seq: int
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
            lease_generation=self.lease_generation,
            last_input_seq=self.seqs.received,
        )
        out.append(Send(resumed))
        return out

    def adopted(self, position: Fence, engine_input_seq: int, token_hash: bytes) -> None:
        """This front end takes the session over from one that is gone (a crash, a drain):
        it continues at the engine's position, with the input the engine has."""
        self.epoch = position.epoch
        self.turn_id = position.turn_id
        self.response_seq = position.response_seq
        self.seqs.adopt(engine_input_seq)
        self.token_hash = token_hash

    def taken_over(self, token: str, *, last_seq: int, lost: bool) -> list[Action]:
        """What the client is told after :meth:`adopted`. ``lost``: the old front end may
        have produced events after the client's last one that nobody kept (a crash): the
        client must re-read what it needs (``session.resync_required``, docs/scale.md)."""
        out: list[Action] = [
            ConfigureInput(
                self.config.input_format, self.config.turn_detection, self.config.noise_reduction
            )
        ]
        if lost:
            resync = ev.ResyncRequired(
                reason="front_end_lost", first_available_seq=last_seq + 1, last_seq=last_seq
            )
            out.append(Send(resync))
        resumed = ev.SessionResumed(
            session_id=self.session_id,
            resume_token=token,
            replayed=0,
            lease_generation=self.lease_generation,
            last_input_seq=self.seqs.received,
        )
        out.append(Send(resumed))
        return out

    def too_slow(self) -> list[Action]:
        """The client does not read its output fast enough: the session ends."""
        if self.closed:
            return []
        fatal = SessionFatal("client_too_slow", "the client reads too slowly")
        return [DropOutput(), *self.error(fatal), *self.close("client_too_slow"), Release()]

    def input_refused(self) -> list[Action]:
        """The transport's input backlog is full: this audio was dropped."""
        return self.error(
            ProtocolError(
                "input_backpressure",
                "input audio backlog is full; the audio was dropped (send slower)",
                error_type="rate_limit_error",
            )
        )

    def input_failed(self) -> list[Action]:
        """Processing this session's input failed (a bug, logged by the caller)."""
        return [*self.error(RuntimeError()), CloseSocket(CloseCode.INTERNAL, "server_error")]
