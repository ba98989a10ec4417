"""Epochs: a barge-in, ``response.cancel`` or ``input.cancel`` opens a new epoch, drops the
old epoch's work and re-queues the user's words that were not heard yet; a newer fence on
any call opens its epoch the same way; a close drops the session's work. Pure functions of a
session and the :class:`Effects` they add to."""

from __future__ import annotations

import dataclasses

from duplex_contract.control import SignalCall
from duplex_contract.errors import ControlError
from duplex_contract.fence import Fence
from engine.duplex.effects import Cancel, Effects
from engine.duplex.fencing import merge_forward
from engine.duplex.session import DuplexSession

#: the signals that cancel, and the reason their epoch's work ends with
CANCEL_REASONS = {
    "barge_in": "turn_detected",
    "response.cancel": "client_cancelled",
    "input.cancel": "input_cancelled",
}


def cancel(session: DuplexSession, call: SignalCall, now: float, effects: Effects) -> None:
    """A cancel signal (``call.event`` in :data:`CANCEL_REASONS`): open ``next_fence``'s
    epoch. A late cancel never moves the session backwards; it only cleans up its own epoch."""
    nxt = call.next_fence
    if nxt is None or nxt.session_id != session.session_id:
        raise ControlError(
            f"{call.event} needs next_fence of this session", code="invalid_argument"
        )
    cur = session.fence
    if nxt.epoch <= cur.epoch or call.fence.epoch < cur.epoch:
        if call.fence.epoch < cur.epoch:
            effects.cancels.append(
                Cancel(session.session_id, call.fence.epoch, None, CANCEL_REASONS[call.event])
            )
        return
    if call.event == "response.cancel" and session.pending_turns() == 0:
        raise ControlError("no response in progress", code="nothing_to_cancel")
    if call.event == "input.cancel":
        session.take_input()
        effects.input_reset.append(session.session_id)
    session.lease.activity(now)
    advance(session, nxt, CANCEL_REASONS[call.event], effects)


def advance(session: DuplexSession, proposed: Fence, reason: str, effects: Effects) -> None:
    """Open a new epoch: cancel the old epoch's work, but keep the user's words.

    Committed user input whose transcript is not yet in the history (a queued turn, or
    the running one still in ASR) is re-queued in the new epoch without a response, so
    a pause that split one question into two turns loses nothing.
    """
    old = ([session.active] if session.active is not None else []) + list(session.jobs)
    effects.cancels.append(drop_work(session, reason, session.fence.epoch))
    session.fence = merge_forward(session.fence, proposed)
    session.ops.clear()
    if reason == "input_cancelled":
        return
    f = session.fence
    for job in old:
        if job.heard or not (job.audio or job.text or job.tool_outputs):
            continue
        fence = Fence(f.session_id, f.epoch, job.fence.turn_id, f.response_seq)
        session.jobs.append(
            dataclasses.replace(job, fence=fence, respond=False, response=None, heard=False)
        )
    if session.jobs:
        effects.start.append(session.session_id)


def begin_close(session: DuplexSession, reason: str, effects: Effects) -> None:
    """The session closes: its work is dropped, then the orchestrator cleans it up and
    finishes the close."""
    session.state = "closing"
    session.close_reason = reason
    effects.cancels.append(drop_work(session, reason))
    effects.cleanups.append(session.session_id)


def drop_work(session: DuplexSession, reason: str, epoch: int | None = None) -> Cancel:
    """Drop queued jobs and detach the active one; the caller aborts their stage work. A
    response cut off keeps (in the history) what the client reported it played of it."""
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
