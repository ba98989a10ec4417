"""The control plane's parts, each alone and pure: the session table, the epoch rules, input
sequencing, the other calls, the operation-id cache and the lifecycle (the whole
machine is tests/engine/test_control.py and test_control_stateful.py)."""

from __future__ import annotations

import pytest

from duplex_contract.control import (
    AppendCall,
    CloseCall,
    CommitCall,
    ControlResult,
    OpenCall,
    PlaybackMark,
    ResumeCall,
    SignalCall,
    TouchCall,
)
from duplex_contract.errors import ControlError
from duplex_contract.fence import Fence
from duplex_contract.session_events import SessionLifecycle
from duplex_contract.settings import SessionSettings, SessionUpdate
from duplex_contract.tools import ItemRef
from engine.config import DuplexRuntimeConfig
from engine.duplex import epochs, signals
from engine.duplex.effects import Effects
from engine.duplex.fencing import check_fresh, check_lease
from engine.duplex.lease import Lease
from engine.duplex.lifecycle import Lifecycle
from engine.duplex.operations import OperationCache, digest_of
from engine.duplex.sequencer import InputSequencer
from engine.duplex.session import DuplexSession, TurnJob
from engine.duplex.table import SessionTable
from engine.orchestration.history import ConversationHistory

SID = "sess_a"


def session(sid: str = SID) -> DuplexSession:
    return DuplexSession(
        session_id=sid,
        config=SessionSettings(),
        fence=Fence(sid),
        lease=Lease(created_at=0.0, last_activity=0.0),
        history=ConversationHistory(10_000),
    )


def code_of(exc: pytest.ExceptionInfo[ControlError]) -> str:
    return exc.value.code


# ---------------------------------------------------------------------------- table
def test_the_table_admits_up_to_its_size_and_remembers_ended_sessions() -> None:
    table = SessionTable(max_sessions=1)
    table.reserve()
    table.add(session())
    with pytest.raises(ControlError) as full:
        table.reserve()
    assert code_of(full) == "resource_exhausted"
    assert table.admissions == {"accepted": 1, "rejected": 1}
    assert table.lookup(SID).session_id == SID and table.counts()["open"] == 1
    with pytest.raises(ControlError) as unknown:
        table.lookup("sess_b")
    assert code_of(unknown) == "not_found"
    s = table.sessions[SID]
    s.state, s.close_reason = "closing", "client"
    with pytest.raises(ControlError) as closing:
        table.lookup(SID)
    assert code_of(closing) == "session_expired" and table.counts()["closing"] == 1
    assert table.remove(SID) is s and s.state == "closed" and len(table) == 0
    assert table.ended(SID) and table.remove(SID) is None
    with pytest.raises(ControlError, match="has ended"):
        table.lookup(SID)


# ---------------------------------------------------------------------------- fences
def test_fence_checks() -> None:
    check_lease(2, 2)
    with pytest.raises(ControlError, match="resumed elsewhere"):
        check_lease(1, 2)
    check_fresh(Fence(SID, 1, 2, 2), Fence(SID, 1, 2, 2))
    check_fresh(Fence(SID, 2, 0, 0), Fence(SID, 1, 2, 2))  # a newer epoch is fresh
    with pytest.raises(ControlError) as stale:
        check_fresh(Fence(SID, 1, 1, 2), Fence(SID, 1, 2, 2))
    assert code_of(stale) == "stale_fence"


# ---------------------------------------------------------------------------- epochs
def _job(turn: int) -> TurnJob:
    return TurnJob(fence=Fence(SID, 0, turn, turn), audio=b"\0\0", text="", respond=True)


def test_a_new_epoch_drops_the_work_and_requeues_unheard_words() -> None:
    s = session()
    s.fence = Fence(SID, 0, 2, 2)
    s.active = _job(1)
    s.active.heard = True  # its words are in the history: not queued again
    s.jobs.append(_job(2))
    s.ops.remember("op", "AppendCall", "d", ControlResult(control_id=1, ok=True), 8)
    eff = Effects()
    epochs.advance(s, Fence(SID, 1, 0, 0), "turn_detected", eff)
    assert s.fence == Fence(SID, 1, 2, 2) and not s.ops
    (cancel,) = eff.cancels
    assert (cancel.old_epoch, cancel.reason) == (0, "turn_detected") and cancel.active is not None
    (requeued,) = s.jobs
    assert requeued.fence == Fence(SID, 1, 2, 2) and not requeued.respond
    assert eff.start == [SID] and s.active is None


def _cancel(event: str, fence: Fence, nxt: Fence | None) -> SignalCall:
    return SignalCall(fence=fence, lease_generation=1, event=event, next_fence=nxt)  # type: ignore[arg-type]


def test_cancels_open_the_next_epoch_and_a_late_one_only_cleans_its_own() -> None:
    s = session()
    s.jobs.append(_job(1))
    eff = Effects()
    epochs.cancel(s, _cancel("barge_in", Fence(SID), Fence(SID, 1)), 5.0, eff)
    assert s.fence.epoch == 1 and s.lease.last_activity == 5.0
    late = Effects()
    epochs.cancel(s, _cancel("barge_in", Fence(SID), Fence(SID, 1)), 6.0, late)
    assert s.fence.epoch == 1 and [c.old_epoch for c in late.cancels] == [0]
    assert len(s.jobs) == 1  # the unheard turn, again in the new epoch
    s.jobs.clear()
    with pytest.raises(ControlError) as nothing:
        epochs.cancel(s, _cancel("response.cancel", s.fence, Fence(SID, 2)), 7.0, Effects())
    assert code_of(nothing) == "nothing_to_cancel"
    with pytest.raises(ControlError, match="needs next_fence"):
        epochs.cancel(s, _cancel("barge_in", s.fence, None), 7.0, Effects())


def test_a_close_drops_the_work_and_asks_for_the_clean_up() -> None:
    s = session()
    s.jobs.append(_job(1))
    eff = Effects()
    epochs.begin_close(s, "idle_timeout", eff)
    assert s.state == "closing" and not s.jobs and eff.cleanups == [SID]
    assert eff.cancels[0].reason == "idle_timeout"


# ---------------------------------------------------------------------------- input
def _append(**kw: object) -> AppendCall:
    return AppendCall(fence=Fence(SID), lease_generation=1, **kw)  # type: ignore[arg-type]


def test_input_is_taken_once_per_client_seq_and_bounded() -> None:
    seq = InputSequencer(DuplexRuntimeConfig(max_input_bytes=8))
    s, eff = session(), Effects()
    assert not seq.append(s, _append(audio=b"\1\0", seq=1, stream_ms=20.0), 1, eff).deduplicated
    assert seq.append(s, _append(audio=b"\1\0", seq=1), 2, eff).deduplicated  # a resend
    assert bytes(s.audio) == b"\1\0" and s.audio_stream_ms == 20.0 and s.last_seq == 1
    assert eff.heard == [(SID, b"\1\0")]
    for call, code in [
        (_append(audio=b"\0" * 8), "input_backpressure"),
        (_append(audio=b"\0"), "invalid_argument"),
        (_append(), "invalid_argument"),
        (_append(audio=b"\0\0", expected_epoch=3), "stale_fence"),
    ]:
        with pytest.raises(ControlError) as refused:
            seq.append(s, call, 3, Effects())
        assert code_of(refused) == code


def test_a_commit_makes_a_turn_of_the_input() -> None:
    seq = InputSequencer(DuplexRuntimeConfig(max_pending_turns=1))
    s, eff = session(), Effects()
    seq.append(s, _append(audio=b"\1\0", stream_ms=40.0), 1, eff)
    commit = CommitCall(fence=Fence(SID), lease_generation=1, item_id="item_1")
    res = seq.commit(s, commit, 2, eff)
    assert res.accepted_fence == Fence(SID, 0, 1, 1) and not s.audio
    (job,) = s.jobs
    assert (job.audio, job.stream_ms, job.audio_item, job.respond) == (
        b"\1\0",
        40.0,
        "item_1",
        True,
    )
    assert eff.committed == [(SID, b"\1\0", 40.0)] and eff.start == [SID]
    with pytest.raises(ControlError) as pending:
        seq.commit(s, commit, 3, Effects())
    assert code_of(pending) == "input_backpressure"
    s.jobs.clear()
    with pytest.raises(ControlError) as empty:
        seq.commit(s, CommitCall(fence=Fence(SID), lease_generation=1, respond=False), 4, eff)
    assert code_of(empty) == "input_audio_buffer_empty"


# ---------------------------------------------------------------------------- signals
def test_touch_and_signals() -> None:
    s, eff = session(), Effects()
    detach = TouchCall(fence=Fence(SID), lease_generation=1, activity="detach")
    signals.touch(s, detach, 1, 3.0)
    assert s.lease.detached_at == 3.0
    s.active = _job(1)
    mark = PlaybackMark(1, 1, 250.0)
    ack = TouchCall(fence=Fence(SID), lease_generation=1, activity="playback_ack", playback=mark)
    assert signals.touch(s, ack, 2, 4.0).clamped_ms == 250.0 and s.played == {(1, 1): 250.0}
    s.audio += b"\1\0"
    pause = SignalCall(fence=s.fence, lease_generation=1, event="input.pause", respond=False)
    signals.signal(s, pause, 3, eff)
    assert eff.speculate == [(s.fence, b"\1\0", False)]
    resume = SignalCall(fence=s.fence, lease_generation=1, event="input.resume")
    signals.signal(s, resume, 4, eff)
    assert eff.unspeculate == [SID]
    upd = SessionUpdate(instructions="terse")
    signals.signal(
        s, SignalCall(fence=s.fence, lease_generation=1, event="session.update", update=upd), 5, eff
    )
    assert s.config.instructions == "terse"


def test_item_delete_drops_a_queued_turns_text() -> None:
    s = session()
    job = _job(1)
    job.items, job.text = (("item_1", "hello"), ("item_2", "world")), "hello world"
    s.jobs.append(job)
    signals.delete_item(s, ItemRef(item_id="item_1"))
    assert job.items == (("item_2", "world"),) and job.text == "world"


# ---------------------------------------------------------------------------- operations
def test_the_operation_cache_replays_and_refuses_a_reused_id() -> None:
    ops = OperationCache()
    first = ControlResult(control_id=1, ok=True, session_id=SID, clamped_ms=5.0)
    assert ops.replay("op1", "d1", 2) is None
    ops.remember("op1", "CommitCall", "d1", first, cap=2)
    again = ops.replay("op1", "d1", 7)
    assert again is not None and again.deduplicated and again.control_id == 7
    assert again.clamped_ms == 5.0
    with pytest.raises(ControlError, match="different call"):
        ops.replay("op1", "other", 8)
    ops.remember("op2", "CommitCall", "d2", first, cap=2)
    ops.remember("op3", "CommitCall", "d3", first, cap=2)
    assert len(ops) == 2 and ops.replay("op1", "d1", 9) is None  # the oldest went
    assert digest_of("a", b"b") == digest_of("a", b"b") != digest_of("a", b"c")


# ---------------------------------------------------------------------------- lifecycle
def test_a_sessions_life_open_resume_close_and_finish() -> None:
    table = SessionTable(4)
    life = Lifecycle(DuplexRuntimeConfig(), table)
    opened = life.open(OpenCall(route_key="w7"), 1, 0.0)
    sid = opened.session_id
    assert sid is not None and sid.startswith("sess_w7_") and opened.lease_generation == 1
    with pytest.raises(ControlError) as bad:
        life.open(OpenCall(route_key="W7/x"), 2, 0.0)
    assert code_of(bad) == "invalid_argument"
    peek = life.resume(ResumeCall(sid, 0, peek=True), 3, 1.0)
    assert peek.lease_generation == 1
    assert life.resume(ResumeCall(sid, 1), 4, 1.0).lease_generation == 2
    with pytest.raises(ControlError) as stale:
        life.resume(ResumeCall(sid, 1), 5, 1.0)
    assert code_of(stale) == "stale_lease"
    assert life.detach(sid, 2.0) and table.counts()["detached"] == 1
    eff = Effects()
    fence = table.sessions[sid].fence
    life.close(CloseCall(fence=fence, lease_generation=2), 6, eff)
    assert eff.cleanups == [sid] and not life.detach(sid, 3.0)
    done = life.finish_close(sid)
    (closed,) = done.events
    assert isinstance(closed.event, SessionLifecycle) and closed.event.state == "closed"
    assert life.close(CloseCall(fence=fence, lease_generation=2), 7, Effects()).ok  # idempotent


def test_the_reaper_warns_then_expires_a_detached_session() -> None:
    table = SessionTable(4)
    cfg = DuplexRuntimeConfig(disconnect_grace_s=10.0, expiring_warning_s=5.0, idle_ttl_s=None)
    life = Lifecycle(cfg, table)
    sid = life.open(OpenCall(), 1, 0.0).session_id
    assert sid is not None
    life.detach(sid, 0.0)
    assert life.tick(4.0, set()).events == []
    (warning,) = life.tick(6.0, set()).events
    assert isinstance(warning.event, SessionLifecycle) and warning.event.state == "expiring"
    assert life.tick(7.0, set()).events == []  # warned once
    expired = life.tick(10.0, set())
    assert expired.cleanups == [sid] and table.sessions[sid].state == "closing"
    assert life.tick(11.0, {sid}).cleanups == []  # its clean-up runs: not asked again
