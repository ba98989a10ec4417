"""The duplex control plane as a synchronous state machine (docs/engine.md).

:class:`DuplexControl` takes control calls with the current time and returns a typed
:class:`ControlResult` plus :class:`Effects` for the orchestrator to carry out (start turn
jobs, cancel an epoch's work, clean a closing session up, publish lifecycle events). It
never awaits, never reads the clock and touches no queue, so every rule is unit- and
property-testable; the orchestrator thread is its only caller, so calls of one session run
in arrival order and no session ever waits on another. The one exception is
:meth:`DuplexControl.counts` (metrics, from the server thread): it reads the session table
under :attr:`DuplexControl.table_lock`, which every insert and removal also holds.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from duplex_contract.audio import INPUT_RATE
from engine.config import DuplexRuntimeConfig
from engine.duplex import replica
from engine.duplex.fence import ROUTE_KEY, initial_fence, merge_forward, new_session_id
from engine.duplex.lease import Lease
from engine.duplex.session import DuplexSession, TurnJob, digest_of
from engine.errors import ControlError
from engine.history import ConversationHistory
from engine.messages import (
    AppendCall,
    CloseCall,
    CommitCall,
    ControlCall,
    ControlResult,
    ErrorInfo,
    Fence,
    OpenCall,
    ReplicaCall,
    ResumeCall,
    SessionLifecycle,
    SessionOutput,
    SignalCall,
    ToolOutput,
    TouchCall,
)

log = logging.getLogger(__name__)

CANCEL_REASONS = {
    "barge_in": "turn_detected",
    "response.cancel": "client_cancelled",
    "input.cancel": "input_cancelled",
}
_TOMBSTONES = 100_000


@dataclass
class Cancel:
    """Stop every piece of work of ``old_epoch``; ``active`` was the running turn job."""

    session_id: str
    old_epoch: int
    active: TurnJob | None
    reason: str


@dataclass
class Effects:
    start: list[str] = field(default_factory=list)  # sessions with newly queued jobs
    cancels: list[Cancel] = field(default_factory=list)
    cleanups: list[str] = field(default_factory=list)  # sessions to abort and then finish_close
    events: list[SessionOutput] = field(default_factory=list)
    # ASR ahead of the commit: (fence, input so far, the commit will ask for a response)
    speculate: list[tuple[Fence, bytes, bool]] = field(default_factory=list)
    unspeculate: list[str] = field(default_factory=list)
    heard: list[tuple[str, bytes]] = field(default_factory=list)  # audio for live partials
    input_reset: list[str] = field(default_factory=list)  # the input buffer was taken/cleared
    # committed turns with audio: (session, the job's audio, where it starts on the input clock)
    committed: list[tuple[str, bytes, float | None]] = field(default_factory=list)


def _err(code: str, message: str) -> ControlError:
    return ControlError(message, code=code)


class DuplexControl:
    def __init__(self, config: DuplexRuntimeConfig, default_instructions: str = "") -> None:
        self.config = config
        self.default_instructions = default_instructions
        self.sessions: dict[str, DuplexSession] = {}
        #: held by every insert into and removal from ``sessions`` and by ``counts``
        self.table_lock = threading.Lock()
        self.tombstones: OrderedDict[str, str] = OrderedDict()
        self.admissions = {"accepted": 0, "rejected": 0}

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

    def _append(
        self, session: DuplexSession, call: AppendCall, control_id: int, effects: Effects
    ) -> ControlResult:
        if call.expected_epoch is not None and call.expected_epoch != session.fence.epoch:
            raise _err(
                "stale_fence",
                f"expected epoch {call.expected_epoch}, current {session.fence.epoch}",
            )
        if not call.audio and not (call.text and call.text.strip()) and call.tool_output is None:
            raise _err("invalid_argument", "append needs audio, text or a tool output")
        if len(call.audio) % 2:
            raise _err("invalid_argument", "audio must be whole PCM16 samples (even byte count)")
        if call.audio and call.sample_rate != INPUT_RATE:
            raise _err("invalid_argument", f"input audio must be {INPUT_RATE} Hz")
        if call.seq is not None and session.last_seq is not None and call.seq <= session.last_seq:
            return self._ok(control_id, session, deduplicated=True)
        size = len(session.audio) + len(call.audio) + sum(map(len, session.text_parts))
        size += len(call.text or "") + sum(len(o.output) for o in session.tool_outputs)
        size += len(call.tool_output.output) if call.tool_output is not None else 0
        if size > self.config.max_input_bytes:
            raise _err(
                "input_backpressure",
                f"input buffer over {self.config.max_input_bytes} bytes; commit or clear",
            )
        if call.audio and not session.audio:
            session.audio_stream_ms = call.stream_ms
        session.audio += call.audio
        if call.audio:
            effects.heard.append((session.session_id, call.audio))
        if call.text:
            session.text_parts.append(call.text)
            session.text_items.append((call.item_id, call.text))
        if call.tool_output is not None:
            session.tool_outputs.append(call.tool_output)
        if call.seq is not None:
            session.last_seq = call.seq
        return self._ok(control_id, session)

    def _commit(
        self, session: DuplexSession, call: CommitCall, control_id: int, effects: Effects
    ) -> ControlResult:
        oob = call.response is not None and call.response.conversation == "none"
        has_input = session.has_input() and not oob  # out of band: the input stays
        if not has_input and not call.respond:
            raise _err("input_audio_buffer_empty", "nothing to commit: the input buffer is empty")
        if session.pending_turns() >= self.config.max_pending_turns:
            raise _err(
                "input_backpressure", f"{self.config.max_pending_turns} turns are already pending"
            )
        audio, text = b"", ""
        stream_ms = session.audio_stream_ms
        items: tuple[tuple[str | None, str], ...] = ()
        tools: tuple[ToolOutput, ...] = ()
        if not oob:
            audio, text, items, tools = session.take_turn()
            effects.input_reset.append(session.session_id)
        f = session.fence
        session.fence = Fence(
            f.session_id,
            f.epoch,
            f.turn_id + (1 if has_input else 0),
            f.response_seq + (1 if call.respond else 0),
        )
        session.jobs.append(
            TurnJob(
                fence=session.fence,
                audio=audio,
                text=text,
                respond=call.respond,
                stream_ms=stream_ms if audio else None,
                items=items,
                tool_outputs=tools,
                audio_item=call.item_id if audio else None,
                response=call.response if call.respond else None,
                traceparent=call.traceparent,
            )
        )
        if audio:
            effects.committed.append((session.session_id, audio, stream_ms))
        effects.start.append(session.session_id)
        return self._ok(control_id, session)

    def _touch(
        self, session: DuplexSession, call: TouchCall, control_id: int, now: float
    ) -> ControlResult:
        if call.activity == "detach":
            session.lease.detach(now)
        elif call.activity == "playback_ack":
            mark = call.playback
            if mark is None:
                raise _err(
                    "invalid_argument",
                    "playback_ack needs playback{turn_id, response_seq, played_ms}",
                )
            if mark.played_ms < 0:
                raise _err("invalid_argument", "played_ms must be >= 0")
            key = (mark.turn_id, mark.response_seq)
            active = session.active
            running = (
                active is not None and (active.fence.turn_id, active.fence.response_seq) == key
            )
            if running:  # only the running response's mark is needed (a barge-in cuts it)
                session.played.clear()
                session.played[key] = mark.played_ms
            if mark.truncate or not running:
                try:
                    clamped = session.history.truncate(
                        mark.turn_id, mark.response_seq, mark.played_ms
                    )
                except KeyError:
                    raise _err("invalid_argument", f"no assistant turn {key}") from None
                return self._ok(control_id, session, clamped_ms=clamped)
            return self._ok(control_id, session, clamped_ms=mark.played_ms)
        return self._ok(control_id, session)

    def _signal(
        self, session: DuplexSession, call: SignalCall, control_id: int, effects: Effects
    ) -> ControlResult:
        if call.event == "input.pause":
            if session.audio:
                effects.speculate.append((session.fence, bytes(session.audio), call.respond))
            return self._ok(control_id, session)
        if call.event == "input.resume":
            effects.unspeculate.append(session.session_id)
            return self._ok(control_id, session)
        if call.event == "item.delete":
            return self._delete(session, call, control_id)
        upd = call.update
        if upd is None:
            raise _err("invalid_argument", "session.update needs update")
        session.config = upd.apply(session.config)
        return self._ok(control_id, session)

    def _delete(self, session: DuplexSession, call: SignalCall, control_id: int) -> ControlResult:
        """Drop an item from the input or the history; the next prompt no longer has it.

        A turn queued or still transcribing that took the item drops it too; words already
        in a prompt being answered stay in that one answer only."""
        ref = call.item
        if ref is None:
            raise _err("invalid_argument", "item.delete needs item")
        found = False
        if ref.item_id is not None:
            found = session.drop_item(ref.item_id) or session.history.delete_item(ref.item_id)
            active = [session.active] if session.active is not None else []
            for job in [*session.jobs, *active]:  # taken, not yet in the history
                if ref.item_id in (job.audio_item, *(i for i, _ in job.items)):
                    found = True
                    job.items = tuple((i, t) for i, t in job.items if i != ref.item_id)
                    job.text = " ".join(t for _, t in job.items if t.strip())
                    job.audio_deleted = job.audio_deleted or job.audio_item == ref.item_id
        if ref.turn_id is not None and ref.response_seq is not None:
            found = session.history.delete_assistant(ref.turn_id, ref.response_seq) or found
        if not found:  # e.g. an audio item with no words: nothing to drop, not an error
            log.debug("%s: item.delete found nothing to drop", session.session_id)
        return self._ok(control_id, session)

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

    # ------------------------------------------------------------------ orchestrator hooks
    def next_job(self, session_id: str) -> TurnJob | None:
        session = self.sessions.get(session_id)
        if session is None or session.state != "open" or session.active is not None:
            return None
        if not session.jobs:
            return None
        session.active = session.jobs.popleft()
        return session.active

    def job_done(self, session_id: str, job: TurnJob, now: float) -> None:
        session = self.sessions.get(session_id)
        if session is None or session.active is not job:
            return  # cancelled or closed meanwhile: already accounted for
        session.active = None
        session.lease.activity(now)

    def is_current(self, fence: Fence) -> bool:
        """May output tagged with ``fence`` still be delivered?"""
        session = self.sessions.get(fence.session_id)
        return (
            session is not None and session.state == "open" and fence.epoch == session.fence.epoch
        )

    def tick(self, now: float, cleaning: set[str]) -> Effects:
        """Reaper: warn, expire, and retry cleanups that are not running."""
        effects = Effects()
        cfg = self.config
        for session in list(self.sessions.values()):
            sid = session.session_id
            if session.state == "closing":
                if sid not in cleaning:
                    effects.cleanups.append(sid)
                continue
            due = session.lease.deadline(cfg, busy=session.pending_turns() > 0)
            if due is None:
                continue
            deadline, reason = due
            if now >= deadline:
                effects.events.append(
                    SessionOutput(
                        session_id=sid,
                        event=SessionLifecycle(session_id=sid, state="expired", reason=reason),
                    )
                )
                self._begin_close(session, reason, effects)
            elif deadline - now <= cfg.expiring_warning_s and session.lease.warned_for != deadline:
                session.lease.warned_for = deadline
                effects.events.append(
                    SessionOutput(
                        session_id=sid,
                        event=SessionLifecycle(
                            session_id=sid,
                            state="expiring",
                            reason=reason,
                            in_s=round(deadline - now, 3),
                        ),
                    )
                )
        return effects

    def detach(self, session_id: str, now: float) -> bool:
        """Detach a session whose front end is gone (no fence: nobody is left to hold one).
        Returns False for an unknown or closing session."""
        session = self.sessions.get(session_id)
        if session is None or session.state != "open":
            return False
        session.lease.detach(now)
        return True

    def counts(self) -> dict[str, int]:
        """Sessions by state; safe to call from another thread (metrics)."""
        out = {"open": 0, "detached": 0, "closing": 0}
        with self.table_lock:
            sessions = list(self.sessions.values())
        for s in sessions:
            if s.state == "closing":
                out["closing"] += 1
            elif s.lease.detached_at is not None:
                out["detached"] += 1
            else:
                out["open"] += 1
        return out
