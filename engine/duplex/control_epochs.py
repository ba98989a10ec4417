"""Cancels and new epochs: a barge-in, ``response.cancel`` or ``input.cancel`` opens a new
epoch, drops the old epoch's work and re-queues the user's words that were not heard yet."""

from __future__ import annotations

import dataclasses

from duplex_contract.control import ControlResult, SignalCall
from duplex_contract.fence import Fence
from engine.duplex.control_core import _err
from engine.duplex.control_hooks import ControlHooks
from engine.duplex.effects import Cancel, Effects
from engine.duplex.fence import merge_forward
from engine.duplex.session import DuplexSession

CANCEL_REASONS = {
    "barge_in": "turn_detected",
    "response.cancel": "client_cancelled",
    "input.cancel": "input_cancelled",
}


class ControlEpochs(ControlHooks):
    """Cancel signals and the epoch advance every newer fence causes."""

    # ------------------------------------------------------------------ cancels
    def _cancel(
        self,
        session: DuplexSession,
        call: SignalCall,
        control_id: int,
        now: float,
        effects: Effects,
    ) -> ControlResult:
        nxt = call.next_fence
        if nxt is None or nxt.session_id != session.session_id:
            raise _err("invalid_argument", f"{call.event} needs next_fence of this session")
        cur = session.fence
        if nxt.epoch <= cur.epoch or call.fence.epoch < cur.epoch:
            # A late cancel never moves the session backwards; it only cleans up its own epoch.
            if call.fence.epoch < cur.epoch:
                effects.cancels.append(
                    Cancel(session.session_id, call.fence.epoch, None, CANCEL_REASONS[call.event])
                )
            return self._ok(control_id, session)
        if call.event == "response.cancel" and session.pending_turns() == 0:
            raise _err("nothing_to_cancel", "no response in progress")
        if call.event == "input.cancel":
            session.take_input()
            effects.input_reset.append(session.session_id)
        session.lease.activity(now)
        self._advance(session, nxt, CANCEL_REASONS[call.event], effects)
        return self._ok(control_id, session)

    def _advance(
        self, session: DuplexSession, proposed: Fence, reason: str, effects: Effects
    ) -> None:
        """Open a new epoch: cancel the old epoch's work, but keep the user's words.

        Committed user input whose transcript is not yet in the history (a queued turn, or
        the running one still in ASR) is re-queued in the new epoch without a response, so
        a pause that split one question into two turns loses nothing.
        """
        old = ([session.active] if session.active is not None else []) + list(session.jobs)
        effects.cancels.append(self._drop_work(session, reason, session.fence.epoch))
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
