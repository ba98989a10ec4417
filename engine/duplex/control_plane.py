"""The duplex control plane as a synchronous state machine (docs/engine.md).

:class:`DuplexControl` takes control calls with the current time and returns a typed
:class:`ControlResult` plus :class:`Effects` for the orchestrator to carry out (start turn
jobs, cancel an epoch's work, clean a closing session up, publish lifecycle events). It
never awaits, never reads the clock and touches no queue, so every rule is unit- and
property-testable; the orchestrator thread is its only caller, so calls of one session run
in arrival order and no session ever waits on another. The one exception is
:meth:`DuplexControl.counts` (metrics, from the server thread): it reads the session table
under the table's lock, which every insert and removal also holds.

It holds its parts, each with one job: the session table (engine/duplex/table.py), the
sessions' lifecycle (lifecycle.py: open, resume, close, expiry, detach), input sequencing
(sequencer.py: append and commit); it uses the epoch rules (epochs.py: cancels and new epochs),
the other calls (signals.py: touch, pause, resume, item.delete, session.update), the fence
checks (fencing.py), each session's operation-id cache (operations.py) and the replica
(replica.py). Here: the dispatch, the fence and lease checks and the orchestrator's hooks.
The orchestrator's effects are in engine/duplex/effects.py.
"""

from __future__ import annotations

from collections.abc import Mapping

from duplex_contract.control import (
    AppendCall,
    CloseCall,
    CommitCall,
    ControlCall,
    ControlResult,
    OpenCall,
    ReplicaCall,
    ResumeCall,
    SignalCall,
    TouchCall,
)
from duplex_contract.errors import ControlError
from duplex_contract.fence import Fence
from duplex_contract.session_events import ErrorInfo
from engine.config import DuplexRuntimeConfig
from engine.duplex import epochs, replica, signals
from engine.duplex.effects import Effects
from engine.duplex.fencing import check_fresh, check_lease
from engine.duplex.lifecycle import Lifecycle
from engine.duplex.operations import digest_of
from engine.duplex.sequencer import InputSequencer
from engine.duplex.session import DuplexSession, TurnJob
from engine.duplex.table import SessionTable


class DuplexControl:
    """The control plane's entry point: :meth:`handle` takes every control call; the
    orchestrator's hooks (the turn queue, the reaper, detach, counts) are below it."""

    def __init__(self, config: DuplexRuntimeConfig, default_instructions: str = "") -> None:
        self.config = config
        self.default_instructions = default_instructions
        self.table = SessionTable(config.max_sessions)
        self.lifecycle = Lifecycle(config, self.table)
        self.input = InputSequencer(config)

    @property
    def sessions(self) -> Mapping[str, DuplexSession]:
        """Every session not yet finished, by id (open or closing)."""
        return self.table.sessions

    @property
    def admissions(self) -> dict[str, int]:
        """Sessions accepted and refused (at capacity) so far."""
        return self.table.admissions

    # ------------------------------------------------------------------ dispatch
    def handle(
        self, call: ControlCall, control_id: int, now: float
    ) -> tuple[ControlResult, Effects]:
        effects = Effects()
        sid: str | None = None
        if isinstance(call, ResumeCall):
            sid = call.session_id
        elif not isinstance(call, OpenCall):
            sid = call.fence.session_id
        try:
            if isinstance(call, OpenCall):
                result = self.lifecycle.open(call, control_id, now)
            elif isinstance(call, ResumeCall):
                result = self.lifecycle.resume(call, control_id, now)
            elif isinstance(call, CloseCall):
                result = self.lifecycle.close(call, control_id, effects)
            elif isinstance(call, ReplicaCall):
                result = replica.keep(self.table, call, control_id)
            else:
                result = self._fenced(call, control_id, now, effects)
        except ControlError as exc:
            result = ControlResult(
                control_id=control_id,
                ok=False,
                session_id=sid,
                error=ErrorInfo.from_exc(exc, session_id=sid),
            )
        return result, effects

    def _fenced(
        self,
        call: AppendCall | CommitCall | SignalCall | TouchCall,
        control_id: int,
        now: float,
        effects: Effects,
    ) -> ControlResult:
        """A call on an open session: the lease and operation-id checks, then the fence
        (a newer epoch is adopted, an older fence refused; a cancel brings its own)."""
        session = self.table.lookup(call.fence.session_id)
        check_lease(call.lease_generation, session.lease.generation)
        op_id = None if isinstance(call, TouchCall) else call.operation_id
        digest = ""
        if op_id is not None:
            digest = digest_of(type(call).__name__, call)
            replayed = session.ops.replay(op_id, digest, control_id)
            if replayed is not None:
                return replayed
        if isinstance(call, SignalCall) and call.event in epochs.CANCEL_REASONS:
            epochs.cancel(session, call, now, effects)
            result = session.ok(control_id)
        else:
            check_fresh(call.fence, session.fence)
            if call.fence.epoch > session.fence.epoch:  # newer epoch: adopt it, drop the old work
                epochs.advance(session, call.fence, "fence_advanced", effects)
            session.lease.activity(now)
            if isinstance(call, AppendCall):
                result = self.input.append(session, call, control_id, effects)
            elif isinstance(call, CommitCall):
                result = self.input.commit(session, call, control_id, effects)
            elif isinstance(call, TouchCall):
                result = signals.touch(session, call, control_id, now)
            else:
                result = signals.signal(session, call, control_id, effects)
        if op_id is not None and result.ok:
            session.ops.remember(
                op_id, type(call).__name__, digest, result, self.config.operation_cache
            )
        return result

    # ------------------------------------------------------------------ orchestrator hooks
    def next_job(self, session_id: str) -> TurnJob | None:
        """The session's next queued turn becomes its running one (None: busy or none)."""
        session = self.table.get(session_id)
        if session is None or session.state != "open" or session.active is not None:
            return None
        if not session.jobs:
            return None
        session.active = session.jobs.popleft()
        return session.active

    def job_done(self, session_id: str, job: TurnJob, now: float) -> None:
        session = self.table.get(session_id)
        if session is None or session.active is not job:
            return  # cancelled or closed meanwhile: already accounted for
        session.active = None
        session.lease.activity(now)

    def is_current(self, fence: Fence) -> bool:
        """May output tagged with ``fence`` still be delivered?"""
        session = self.table.get(fence.session_id)
        return (
            session is not None and session.state == "open" and fence.epoch == session.fence.epoch
        )

    def tick(self, now: float, cleaning: set[str]) -> Effects:
        """Reaper: warn, expire, and retry cleanups that are not running."""
        return self.lifecycle.tick(now, cleaning)

    def detach(self, session_id: str, now: float) -> bool:
        """Detach a session whose front end is gone; False for an unknown or closing one."""
        return self.lifecycle.detach(session_id, now)

    def finish_close(self, session_id: str) -> Effects:
        """The orchestrator finished aborting this session's work: free the slot."""
        return self.lifecycle.finish_close(session_id)

    def counts(self) -> dict[str, int]:
        """Sessions by state; safe to call from another thread (metrics)."""
        return self.table.counts()
