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
checks (fencing.py), each session's operation-id cache (operations.py), the replica and the
item records (replica.py) and the kept records (records.py). Here: the dispatch, retries
(a call repeated with its ``operation_id`` gets its first answer), the fence and lease
checks, what the session store must keep before an answer goes out (``Effects.save``), and
the orchestrator's hooks. The orchestrator's effects are in engine/duplex/effects.py.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from duplex_contract.control import (
    AppendCall,
    CloseCall,
    CommitCall,
    ControlCall,
    ControlResult,
    ItemsCall,
    OpenCall,
    ReplicaCall,
    ResumeCall,
    SignalCall,
    TouchCall,
)
from duplex_contract.errors import ControlError
from duplex_contract.fence import Fence
from duplex_contract.session_events import ErrorInfo, SessionLifecycle
from engine.config import DuplexRuntimeConfig
from engine.duplex import epochs, replica, signals
from engine.duplex.effects import Effects
from engine.duplex.fencing import check_fresh, check_lease
from engine.duplex.lifecycle import Lifecycle
from engine.duplex.operations import call_digest
from engine.duplex.records import KeptSession, rebuild
from engine.duplex.sequencer import InputSequencer
from engine.duplex.session import DuplexSession, TurnJob
from engine.duplex.table import SessionTable
from engine.messages import SessionOutput

#: signals whose effect the session store need not keep (a speculation hint)
_UNSAVED_SIGNALS = ("input.pause", "input.resume")


def saves(call: ControlCall) -> bool:
    """Must the session store keep what ``call`` did before its answer goes out? Not for an
    append (the front end keeps it until a later answer says ``saved``), a heartbeat or
    attach, a speculation hint or a peek; a close is forgotten when the session ends; items
    are kept on their own (``Effects.items``)."""
    if isinstance(call, AppendCall | CloseCall | ItemsCall):
        return False
    if isinstance(call, TouchCall):
        return call.activity == "playback_ack"
    if isinstance(call, SignalCall):
        return call.event not in _UNSAVED_SIGNALS
    if isinstance(call, ResumeCall):
        return not (call.peek or call.reattach)
    return True


class DuplexControl:
    """The control plane's entry point: :meth:`handle` takes every control call; the
    orchestrator's hooks (the turn queue, the reaper, detach, counts) are below it."""

    def __init__(self, config: DuplexRuntimeConfig, default_instructions: str = "") -> None:
        self.config = config
        self.default_instructions = default_instructions
        self.table = SessionTable(config.max_sessions)
        self.lifecycle = Lifecycle(config, self.table)
        self.input = InputSequencer(config)
        #: a session store keeps the sessions (the orchestrator writes ``Effects.save``):
        #: answers say ``saved``
        self.durable = False

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
            replayed = self._replay(call, sid, control_id)
            if replayed is not None:
                return replayed, effects
            if isinstance(call, OpenCall):
                result = self.lifecycle.open(call, control_id, now)
                sid = result.session_id
            elif isinstance(call, ResumeCall):
                result = self.lifecycle.resume(call, control_id, now)
            elif isinstance(call, CloseCall):
                result = self.lifecycle.close(call, control_id, effects)
            elif isinstance(call, ReplicaCall):
                result = replica.keep(self.table, call, control_id)
            elif isinstance(call, ItemsCall):
                result, changes = replica.items(self.table, call, control_id)
                if self.durable:
                    effects.items.append(changes)
                    result = msgspec.structs.replace(result, saved=True)
            else:
                result = self._fenced(call, control_id, now, effects)
        except ControlError as exc:
            result = ControlResult(
                control_id=control_id,
                ok=False,
                session_id=sid,
                error=ErrorInfo.from_exc(exc, session_id=sid),
            )
        if result.ok and sid is not None:
            if self.durable and saves(call):
                effects.save.append(sid)
                result = msgspec.structs.replace(result, saved=True)
            self._remember(call, sid, result)
        return result, effects

    # ------------------------------------------------------------------ retries
    def _replay(self, call: ControlCall, sid: str | None, control_id: int) -> ControlResult | None:
        """The first answer of a call repeated with its ``operation_id`` (None: a new one).
        Raises ``invalid_argument`` for an id used on another call."""
        op_id = call.operation_id
        if op_id is None or (isinstance(call, ResumeCall) and call.peek):
            return None
        if isinstance(call, OpenCall):
            opened = self.table.opened.get(op_id)
            session = self.table.get(opened) if opened is not None else None
            return None if session is None else session.ok(control_id, deduplicated=True)
        session = self.table.get(sid) if sid is not None else None
        if session is None:
            return None
        return session.ops.replay(op_id, call_digest(call), control_id)

    def _remember(self, call: ControlCall, sid: str, result: ControlResult) -> None:
        op_id = call.operation_id
        if op_id is None or (isinstance(call, ResumeCall) and call.peek):
            return
        session = self.table.get(sid)
        if session is None:
            return
        if isinstance(call, OpenCall):
            session.open_op = op_id
            self.table.remember_open(op_id, sid)
            return
        cap = self.config.operation_cache
        session.ops.remember(op_id, type(call).__name__, call_digest(call), result, cap)

    def _fenced(
        self,
        call: AppendCall | CommitCall | SignalCall | TouchCall,
        control_id: int,
        now: float,
        effects: Effects,
    ) -> ControlResult:
        """A call on an open session: the lease check, then the fence (a newer epoch is
        adopted, an older fence refused; a cancel brings its own)."""
        session = self.table.lookup(call.fence.session_id)
        check_lease(call.lease_generation, session.lease.generation)
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

    def restore(self, kept: list[KeptSession], now: float) -> Effects:
        """Take back the sessions of the session store after an engine restart
        (engine/duplex/records.py: detached, the running answer dropped, the turns not
        answered queued again). Each gets ``SessionLifecycle(restored)`` (with the dropped
        answer's fence), which waits for its front end."""
        effects = Effects()
        self.durable = True
        for one in kept:
            session, dropped = rebuild(one, self.config.history_budget_chars, now)
            sid = session.session_id
            self.table.add(session)
            if session.open_op is not None:
                self.table.remember_open(session.open_op, sid)
            lifecycle = SessionLifecycle(
                session_id=sid, state="restored", reason="engine_restarted", dropped=dropped
            )
            effects.events.append(SessionOutput(session_id=sid, event=lifecycle))
            if session.jobs:
                effects.start.append(sid)
        return effects
