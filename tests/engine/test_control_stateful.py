"""Hypothesis stateful test of the fence / lease / epoch rules.

Invariants: a refused call never changes state; epochs (and turn/response counters) never
go backwards; every accepted cancel that opens a new epoch hands the old epoch (and its
running job) to the orchestrator to abort, and leaves no work of the old epoch queued.
"""

from __future__ import annotations

from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from duplex_contract.control import (
    AppendCall,
    CommitCall,
    ControlCall,
    OpenCall,
    ResumeCall,
    SignalCall,
    TouchCall,
)
from duplex_contract.fence import Fence
from engine.config import DuplexRuntimeConfig
from engine.duplex.control_plane import DuplexControl
from engine.duplex.session import DuplexSession


def snapshot(s: DuplexSession) -> tuple[Any, ...]:
    return (
        s.fence,
        s.lease.generation,
        bytes(s.audio),
        tuple(s.text_parts),
        len(s.jobs),
        s.active,
        s.state,
    )


class ControlMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.control = DuplexControl(DuplexRuntimeConfig(max_pending_turns=3, max_sessions=3))
        self.now = 0.0
        self.ids = 0
        self.seen: dict[str, list[Fence]] = {}
        self.high: dict[str, Fence] = {}

    def call(self, call: ControlCall, sid: str) -> None:
        self.ids += 1
        self.now += 0.01
        session = self.control.sessions[sid]
        before = snapshot(session)
        active_before = session.active
        epoch_before = session.fence.epoch
        res, eff = self.control.handle(call, self.ids, self.now)
        after = snapshot(session)
        if not res.ok:
            assert before == after, (call, res.error)
            return
        assert res.accepted_fence == session.fence
        self.seen[sid].append(session.fence)
        if session.fence.epoch > epoch_before:
            olds = [c for c in eff.cancels if c.old_epoch == epoch_before]
            assert olds, "an epoch advanced without aborting the old epoch"
            if active_before is not None:
                assert any(c.active is active_before for c in olds)
            assert session.active is None
            # only the user's unheard input survives, re-queued without a response
            assert all(not j.respond and j.fence.epoch == session.fence.epoch for j in session.jobs)

    def pick(self, data: st.DataObject) -> tuple[str, Fence, int]:
        sid = data.draw(st.sampled_from(list(self.control.sessions)))
        fence = data.draw(st.sampled_from(self.seen[sid]))
        gen = self.control.sessions[sid].lease.generation
        gen = data.draw(st.sampled_from([gen, max(1, gen - 1)]))
        return sid, fence, gen

    @precondition(lambda self: len(self.control.sessions) < 3)
    @rule()
    def open(self) -> None:
        self.ids += 1
        res, _ = self.control.handle(OpenCall(), self.ids, self.now)
        assert res.ok and res.session_id and res.accepted_fence
        self.seen[res.session_id] = [res.accepted_fence]

    @precondition(lambda self: bool(self.control.sessions))
    @rule(data=st.data(), text=st.sampled_from(["hi", "there", ""]), audio=st.integers(0, 3))
    def append(self, data: st.DataObject, text: str, audio: int) -> None:
        sid, fence, gen = self.pick(data)
        self.call(
            AppendCall(fence=fence, lease_generation=gen, text=text or None, audio=b"\0\0" * audio),
            sid,
        )

    @precondition(lambda self: bool(self.control.sessions))
    @rule(data=st.data(), respond=st.booleans())
    def commit(self, data: st.DataObject, respond: bool) -> None:
        sid, fence, gen = self.pick(data)
        self.call(CommitCall(fence=fence, lease_generation=gen, respond=respond), sid)

    @precondition(lambda self: bool(self.control.sessions))
    @rule(
        data=st.data(),
        event=st.sampled_from(["barge_in", "response.cancel", "input.cancel"]),
        bump=st.integers(-1, 2),
    )
    def cancel(self, data: st.DataObject, event: Any, bump: int) -> None:
        sid, fence, gen = self.pick(data)
        cur = self.control.sessions[sid].fence
        nxt = Fence(sid, max(0, cur.epoch + bump), cur.turn_id, cur.response_seq)
        self.call(SignalCall(fence=fence, lease_generation=gen, event=event, next_fence=nxt), sid)

    @precondition(lambda self: bool(self.control.sessions))
    @rule(data=st.data(), activity=st.sampled_from(["heartbeat", "detach", "attach"]))
    def touch(self, data: st.DataObject, activity: Any) -> None:
        sid, fence, gen = self.pick(data)
        self.call(TouchCall(fence=fence, lease_generation=gen, activity=activity), sid)

    @precondition(lambda self: bool(self.control.sessions))
    @rule(data=st.data(), delta=st.integers(-1, 1))
    def resume(self, data: st.DataObject, delta: int) -> None:
        sid = data.draw(st.sampled_from(list(self.control.sessions)))
        gen = self.control.sessions[sid].lease.generation + delta
        self.call(ResumeCall(session_id=sid, expected_lease_generation=gen), sid)

    @precondition(lambda self: bool(self.control.sessions))
    @rule(data=st.data(), finish=st.booleans())
    def run_jobs(self, data: st.DataObject, finish: bool) -> None:
        sid = data.draw(st.sampled_from(list(self.control.sessions)))
        job = self.control.next_job(sid)
        if job is not None and finish:
            self.control.job_done(sid, job, self.now)

    @invariant()
    def never_backwards(self) -> None:
        for sid, s in self.control.sessions.items():
            prev = self.high.get(sid)
            if prev is not None:
                assert s.fence.epoch >= prev.epoch
                if s.fence.epoch == prev.epoch:
                    assert s.fence.turn_id >= prev.turn_id
                    assert s.fence.response_seq >= prev.response_seq
            self.high[sid] = s.fence
            assert all(j.fence.epoch == s.fence.epoch for j in s.jobs)


TestControlMachine = ControlMachine.TestCase
TestControlMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
