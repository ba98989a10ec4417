"""Taking a session over from a front end that is gone (a crash) or draining (a deploy).

A ``session.resume`` for a session this front end does not hold: the engine has the
session (lease, fence, conversation) and the old owner's replica
(duplex_server/session/snapshot.py).
This front end peeks at both, checks the resume token against the replica, renews the lease
with the usual compare and swap (of two front ends racing for one session, one wins;
``stale_lease`` for the other), rebuilds the session core at the engine's position, keeps a
replica of its own (the new token) and tells the client: ``session.resync_required`` when
events may have been lost with the old process, then ``session.resumed``. From then on the
engine sends the session's events here. docs/scale.md describes what can be lost.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import msgspec

from duplex_contract.control import ResumeCall
from duplex_contract.errors import ControlError
from duplex_server.protocol import events as ev
from duplex_server.protocol.errors import SessionFatal
from duplex_server.protocol.machine import SessionMachine
from duplex_server.protocol.resume import new_resume_token, token_matches
from duplex_server.session.attach import Attachment
from duplex_server.session.live import LiveSession
from duplex_server.session.snapshot import decode

if TYPE_CHECKING:
    from duplex_server.session.registry import Sessions

log = logging.getLogger(__name__)


async def adopt(sessions: Sessions, attachment: Attachment, req: ev.SessionResume) -> LiveSession:
    """Raises :class:`SessionFatal` (or an engine error) when the session cannot be taken."""
    engine = sessions.engine
    assert engine is not None
    sid = req.session_id
    not_found = SessionFatal("session_not_found", f"no live session {sid}")
    try:
        peek = await engine.call(ResumeCall(sid, 0, peek=True))
    except ControlError as exc:
        if exc.code in ("not_found", "session_expired"):
            raise not_found from None
        raise
    if not peek.replica:
        raise not_found  # its front end kept no replica (an older one): it cannot move
    try:
        rep = decode(peek.replica, sessions.template())
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        log.warning("%s: unreadable replica: %s", sid, exc)
        raise not_found from None
    if not token_matches(req.resume_token, rep.token_hash):
        raise SessionFatal("invalid_resume_token", "the resume token does not match")
    res = await engine.call(ResumeCall(sid, peek.lease_generation))  # the compare and swap
    assert res.accepted_fence is not None
    core = SessionMachine(sid, rep.config, lease_generation=res.lease_generation)
    token, digest = new_resume_token()
    core.adopted(res.accepted_fence, res.input_seq or 0, digest)
    session = LiveSession(engine, core, sessions.limits, sessions.inputs, sessions.metrics)
    client_seq = req.last_received_server_event_seq
    last = max(client_seq, rep.event_seq)  # numbering goes on after anything it could have
    session.stamper.seq = last
    session.stamper.beta = core.config.beta
    session.journal.restart_at(last)
    sessions.start(session)
    await session.replicate()  # the new token, before the client holds it
    session.attachment = attachment
    lost = not (rep.handed_over and client_seq >= rep.event_seq)
    session.apply(core.taken_over(token, last_seq=last, lost=lost))
    sessions.metrics.sessions_taken_over.labels("crash" if lost else "handover").inc()
    log.info(
        "%s: taken over (lease %d, %s)", sid, res.lease_generation, "lost" if lost else "clean"
    )
    return session
