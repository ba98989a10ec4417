"""The engine's session store (engine/duplex/store.py, records.py): a session kept in the
SQLite file comes back whole in a new control plane (history, items, fence, lease
generation, input buffer and seq, operation ids, replica); the answer that was running is
dropped (and named in ``SessionLifecycle(restored)``), the turns not answered yet come back
to be heard and answered; the store keeps what a call did before its answer says
``saved``, never an append; every call retried with its ``operation_id`` acts once."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from duplex_contract.control import (
    AppendCall,
    CloseCall,
    CommitCall,
    ControlCall,
    ControlResult,
    ItemRecord,
    ItemsCall,
    OpenCall,
    PlaybackMark,
    ReplicaCall,
    ResumeCall,
    SignalCall,
    TouchCall,
)
from duplex_contract.fence import Fence
from duplex_contract.session_events import SessionLifecycle
from duplex_contract.tools import ItemRef
from engine.config import DuplexRuntimeConfig
from engine.duplex.control_plane import DuplexControl
from engine.duplex.effects import Effects
from engine.duplex.item_book import MAX_ITEMS
from engine.duplex.store import SessionStore


class Plane:
    """A control plane with a store, driven by hand (the orchestrator's part too)."""

    def __init__(self, store: SessionStore, now: float = 100.0) -> None:
        self.control = DuplexControl(DuplexRuntimeConfig(disconnect_grace_s=30))
        self.control.durable = True
        self.store = store
        self.now = now
        self.ids = 0

    def do(self, call: ControlCall) -> tuple[ControlResult, Effects]:
        self.ids += 1
        res, eff = self.control.handle(call, self.ids, self.now)
        for sid in eff.save:  # as the orchestrator does, before the answer goes out
            self.store.save(self.control.sessions[sid], self.now)
        for changes in eff.items:
            self.store.save_items(changes)
        return res, eff

    def ok(self, call: ControlCall) -> ControlResult:
        res, _ = self.do(call)
        assert res.ok, res.error
        return res

    def answer(self, sid: str, text: str) -> None:
        """The turn runner: the queued turn's words into the history, then its answer."""
        session = self.control.sessions[sid]
        job = self.control.next_job(sid)
        assert job is not None
        for item_id, part in job.items:
            session.history.add_user(part, job.fence.turn_id, item_id)
        job.heard = True
        self.store.save_conversation(session)
        f = job.fence
        session.history.start_assistant(f.turn_id, f.response_seq)
        session.history.append_assistant(f.turn_id, f.response_seq, text, 0.0, 1000.0)
        session.history.finish_assistant(f.turn_id, f.response_seq, "completed")
        self.control.job_done(sid, job, self.now)
        self.store.save_conversation(session)


def _open(p: Plane) -> tuple[str, Fence]:
    res = p.ok(OpenCall(operation_id="open-1"))
    assert res.session_id and res.accepted_fence and res.saved
    return res.session_id, res.accepted_fence


def test_a_kept_session_comes_back_whole(tmp_path: Path) -> None:
    store = SessionStore(tmp_path / "sessions.db")
    p = Plane(store)
    sid, f = _open(p)
    p.ok(AppendCall(fence=f, lease_generation=1, text="alpha", item_id="it1", seq=1))
    commit = CommitCall(fence=f, lease_generation=1, operation_id="c1")
    first = p.ok(commit)
    assert first.saved
    p.answer(sid, "Alpha it is.")
    f = first.accepted_fence
    assert f is not None
    p.ok(ReplicaCall(fence=f, lease_generation=1, state=b"replica", operation_id="r1"))
    rec = ItemRecord("it1", b"user item")
    p.ok(ItemsCall(fence=f, lease_generation=1, upserts=(rec,), state=b"head", operation_id="i1"))
    p.ok(AppendCall(fence=f, lease_generation=1, audio=b"\1\0" * 80, seq=2))  # not saved
    before = p.control.sessions[sid]
    prompt = before.history.messages("sys")
    store.close()

    later = Plane(SessionStore(tmp_path / "sessions.db"), now=5000.0)
    eff = later.control.restore(later.store.load(), later.now)
    s = later.control.sessions[sid]
    assert s.history.messages("sys") == prompt
    assert s.fence == f and s.lease.generation == 1
    assert s.replica == b"replica" and s.items.records() == (rec,) and s.items.state == b"head"
    assert s.last_seq == 1 and not s.audio  # the unsaved append: the front end sends it again
    assert s.lease.detached_at == 5000.0  # its grace period counts from the restart
    assert s.lease.created_at == 5000.0 - (100.0 - before.lease.created_at)
    assert [o.event for o in eff.events] == [
        SessionLifecycle(session_id=sid, state="restored", reason="engine_restarted")
    ]
    # retries across the restart act once: the commit, and the open
    again = later.ok(commit)
    assert again.deduplicated and again.accepted_fence == f and not s.jobs
    assert later.ok(OpenCall(operation_id="open-1")).session_id == sid
    assert len(later.control.sessions) == 1
    # the owner attaches again at its generation (which stays); a stale one is refused
    back = later.ok(ResumeCall(sid, 1, reattach=True))
    assert back.lease_generation == 1 and s.lease.detached_at is None and back.input_seq == 1
    res, _ = later.do(ResumeCall(sid, 0, reattach=True))
    assert res.error is not None and res.error.code == "stale_lease"


def test_the_running_answer_is_dropped_and_the_turns_not_answered_come_back(
    tmp_path: Path,
) -> None:
    store = SessionStore(tmp_path / "s.db")
    p = Plane(store)
    sid, f = _open(p)
    p.ok(AppendCall(fence=f, lease_generation=1, text="alpha"))
    f = p.ok(CommitCall(fence=f, lease_generation=1)).accepted_fence
    assert f is not None
    session = p.control.sessions[sid]
    job = p.control.next_job(sid)  # the answer runs: words heard, some audio played
    assert job is not None
    session.history.add_user("alpha", job.fence.turn_id)
    job.heard = True
    t, r = job.fence.turn_id, job.fence.response_seq
    session.history.start_assistant(t, r)
    session.history.append_assistant(t, r, "One two ", 0.0, 1000.0)
    session.history.append_assistant(t, r, "three four.", 1000.0, 1000.0)
    p.ok(
        TouchCall(
            fence=f,
            lease_generation=1,
            activity="playback_ack",
            playback=PlaybackMark(t, r, 1000.0),
        )
    )  # saved: the played mark and the history with the running answer
    # then a second turn is committed, not heard yet
    p.ok(AppendCall(fence=f, lease_generation=1, text="bravo"))
    p.ok(CommitCall(fence=f, lease_generation=1, respond=True))
    store.close()

    later = Plane(SessionStore(tmp_path / "s.db"), now=7.0)
    eff = later.control.restore(later.store.load(), later.now)
    s = later.control.sessions[sid]
    # the running answer ends cut to what was played, and is named; the queued turn comes
    # back to be heard and answered
    assert s.history.assistant_text(t, r) == "One two "
    assert [(j.text, j.respond) for j in s.jobs] == [("bravo", True)]
    assert eff.start == [sid]
    (restored,) = [o.event for o in eff.events]
    assert isinstance(restored, SessionLifecycle) and restored.dropped == job.fence


def test_the_store_keeps_what_calls_did_before_they_are_answered(tmp_path: Path) -> None:
    p = Plane(SessionStore(tmp_path / "s.db"))
    sid, f = _open(p)
    res, eff = p.do(AppendCall(fence=f, lease_generation=1, audio=b"\0\0"))
    assert res.ok and not res.saved and eff.save == []
    res, eff = p.do(SignalCall(fence=f, lease_generation=1, event="input.pause"))
    assert res.ok and not res.saved and eff.save == []
    res, eff = p.do(TouchCall(fence=f, lease_generation=1, activity="heartbeat"))
    assert res.ok and not res.saved and eff.save == []
    res, eff = p.do(CommitCall(fence=f, lease_generation=1, respond=False))
    assert res.saved and eff.save == [sid]
    res, eff = p.do(ResumeCall(sid, 0, peek=True))
    assert not res.saved and eff.save == []
    res, eff = p.do(ResumeCall(sid, 1))
    assert res.saved and res.lease_generation == 2
    # a failed call saves nothing
    res, eff = p.do(AppendCall(fence=f, lease_generation=1, text="x"))
    assert not res.ok and eff.save == []


def test_every_call_retried_with_its_operation_id_acts_once(tmp_path: Path) -> None:
    p = Plane(SessionStore(tmp_path / "s.db"))
    sid, f = _open(p)
    p.ok(AppendCall(fence=f, lease_generation=1, text="alpha", item_id="it1"))
    f = p.ok(CommitCall(fence=f, lease_generation=1, respond=False)).accepted_fence
    assert f is not None
    p.answer(sid, "ok")
    session = p.control.sessions[sid]
    calls: list[ControlCall] = [
        AppendCall(fence=f, lease_generation=1, text="x", operation_id="a"),
        SignalCall(
            fence=f, lease_generation=1, event="item.delete", item=ItemRef("it1"), operation_id="d"
        ),
        ItemsCall(fence=f, lease_generation=1, deletes=("it1",), operation_id="i"),
        ReplicaCall(fence=f, lease_generation=1, state=b"r", operation_id="r"),
        TouchCall(fence=f, lease_generation=1, activity="heartbeat", operation_id="h"),
    ]
    for call in calls:
        first = p.ok(call)
        again = p.ok(call)
        assert again.deduplicated and not first.deduplicated
        assert again.accepted_fence == first.accepted_fence
    assert session.text_parts == ["x"]  # the append acted once
    resume = ResumeCall(sid, 1, operation_id="resume")
    first = p.ok(resume)
    again = p.ok(resume)  # a second compare and swap would have been refused
    assert first.lease_generation == again.lease_generation == 2 and again.deduplicated
    close = CloseCall(fence=f, lease_generation=2, operation_id="close")
    assert p.ok(close).ok and p.ok(close).ok  # (idempotent anyway)


def test_items_are_kept_on_their_own_rows(tmp_path: Path) -> None:
    """An ItemsCall writes only the items it changed (not the whole session); a replaced
    record keeps its place, a deleted one and one forgotten past the bound leave the file,
    and the session's end takes its items with it."""
    path = tmp_path / "s.db"
    p = Plane(SessionStore(path))
    sid, f = _open(p)
    recs = [ItemRecord(f"it{i}", b"r%d" % i) for i in range(3)]
    res, eff = p.do(ItemsCall(fence=f, lease_generation=1, upserts=tuple(recs), state=b"h1"))
    assert res.ok and res.saved and eff.save == [] and len(eff.items) == 1
    newer = ItemRecord("it0", b"r0 truncated")
    p.ok(ItemsCall(fence=f, lease_generation=1, upserts=(newer,), deletes=("it1",)))
    (kept,) = SessionStore(path).load()
    assert kept.items == (newer, recs[2]) and kept.items_state == b"h1"
    more = tuple(ItemRecord(f"n{i}", b"x") for i in range(MAX_ITEMS))
    p.ok(ItemsCall(fence=f, lease_generation=1, upserts=more, state=b"h2"))
    (kept,) = SessionStore(path).load()
    assert kept.items == more and kept.items_state == b"h2"  # the oldest two forgotten
    assert p.control.sessions[sid].items.records() == more
    p.store.forget(sid)
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT COUNT(*) FROM items").fetchone() == (0,)
    assert SessionStore(path).load() == []


def test_a_row_that_does_not_decode_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    p = Plane(SessionStore(path))
    sid, _ = _open(p)
    with sqlite3.connect(path) as db:
        db.execute(
            "INSERT INTO sessions (id, control, conversation) VALUES ('sess_bad', x'00', x'00')"
        )
    kept = SessionStore(path).load()
    assert [k.control.session_id for k in kept] == [sid]
