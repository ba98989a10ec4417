"""The duplex control plane as a synchronous state machine (docs/engine.md).

:class:`DuplexControl` takes control calls with the current time and returns a typed
:class:`ControlResult` plus :class:`Effects` for the orchestrator to carry out (start turn
jobs, cancel an epoch's work, clean a closing session up, publish lifecycle events). It
never awaits, never reads the clock and touches no queue, so every rule is unit- and
property-testable; the orchestrator thread is its only caller, so calls of one session run
in arrival order and no session ever waits on another. The one exception is
:meth:`DuplexControl.counts` (metrics, from the server thread): it reads the session table
under :attr:`DuplexControl.table_lock`, which every insert and removal also holds.

By job, as a chain of layers: the session table, open, resume and close in
engine/duplex/control_core.py; the orchestrator's hooks (turn queue, lease reaper, detach,
counts) in control_hooks.py; cancels and epoch advances in control_epochs.py; append,
commit, touch and signals in control_input.py; the dispatch, the fence and lease checks and
the operation_id cache here. The orchestrator's effects are in engine/duplex/effects.py.
"""

from __future__ import annotations

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
from duplex_contract.events import ErrorInfo
from engine.duplex import replica
from engine.duplex.control_core import _err
from engine.duplex.control_epochs import CANCEL_REASONS
from engine.duplex.control_input import ControlInput
from engine.duplex.effects import Effects
from engine.duplex.session import digest_of


class DuplexControl(ControlInput):
    """The control plane's entry point: :meth:`handle` takes every control call."""

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
                result = self._open(call, control_id, now)
            elif isinstance(call, ResumeCall):
                result = self._resume(call, control_id, now)
            elif isinstance(call, CloseCall):
                result = self._close(call, control_id, now, effects)
            elif isinstance(call, ReplicaCall):
                result = replica.keep(self, call, control_id)
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

    # ------------------------------------------------------------------ fenced calls
    def _fenced(
        self,
        call: AppendCall | CommitCall | SignalCall | TouchCall,
        control_id: int,
        now: float,
        effects: Effects,
    ) -> ControlResult:
        session = self._lookup(call.fence.session_id)
        if call.lease_generation != session.lease.generation:
            raise _err(
                "stale_fence",
                f"lease generation {call.lease_generation} is not current "
                f"({session.lease.generation}): the session was resumed elsewhere",
            )
        op_id = None if isinstance(call, TouchCall) else call.operation_id
        digest = ""
        if op_id is not None:
            digest = digest_of(type(call).__name__, call)
            cached = session.ops.get(op_id)
            if cached is not None:
                if cached.digest != digest:
                    raise _err(
                        "invalid_argument", f"operation_id {op_id} was used for a different call"
                    )
                return ControlResult(
                    control_id=control_id,
                    ok=True,
                    session_id=cached.result.session_id,
                    accepted_fence=cached.result.accepted_fence,
                    lease_generation=cached.result.lease_generation,
                    clamped_ms=cached.result.clamped_ms,
                    deduplicated=True,
                )
        if isinstance(call, SignalCall) and call.event in CANCEL_REASONS:
            result = self._cancel(session, call, control_id, now, effects)
        else:
            if call.fence.is_stale_against(session.fence):
                raise _err(
                    "stale_fence", f"stale fence {call.fence.key()} (current {session.fence.key()})"
                )
            if call.fence.epoch > session.fence.epoch:  # newer epoch: adopt it, drop the old work
                self._advance(session, call.fence, "fence_advanced", effects)
            session.lease.activity(now)
            if isinstance(call, AppendCall):
                result = self._append(session, call, control_id, effects)
            elif isinstance(call, CommitCall):
                result = self._commit(session, call, control_id, effects)
            elif isinstance(call, TouchCall):
                result = self._touch(session, call, control_id, now)
            else:
                result = self._signal(session, call, control_id, effects)
        if op_id is not None and result.ok:
            session.remember(
                op_id, type(call).__name__, digest, result, self.config.operation_cache
            )
        return result
