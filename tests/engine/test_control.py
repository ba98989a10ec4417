"""The duplex control plane as a pure state machine: every rule and error code."""

from __future__ import annotations

import pytest

from duplex_contract.control import (
    AppendCall,
    CloseCall,
    CommitCall,
    ControlCall,
    ControlResult,
    OpenCall,
    PlaybackMark,
    ResumeCall,
    SignalCall,
    TouchCall,
)
from duplex_contract.fence import Fence
from duplex_contract.session_events import SessionLifecycle
from duplex_contract.settings import SessionUpdate
from engine.config import DuplexRuntimeConfig
from engine.duplex.control_plane import DuplexControl
from engine.duplex.effects import Effects


class Harness:
    def __init__(self, **cfg: object) -> None:
        self.control = DuplexControl(DuplexRuntimeConfig(**cfg))  # type: ignore[arg-type]
        self.now = 0.0
        self.ids = 0

    def do(self, call: ControlCall) -> tuple[ControlResult, Effects]:
        self.ids += 1
        return self.control.handle(call, self.ids, self.now)

    def ok(self, call: ControlCall) -> ControlResult:
        res, _ = self.do(call)
        assert res.ok, res.error
        return res

    def fails(self, call: ControlCall, code: str) -> ControlResult:
        res, eff = self.do(call)
        assert not res.ok and res.error is not None
        assert res.error.code == code, res.error
        assert eff == Effects()
        return res

    def open(self) -> tuple[str, Fence]:
        res = self.ok(OpenCall())
        assert res.session_id and res.accepted_fence
        return res.session_id, res.accepted_fence


def test_open_admission_and_capacity() -> None:
    h = Harness(max_sessions=2)
    s1, f1 = h.open()
    s2, _ = h.open()
    assert s1.startswith("sess_") and s1 != s2
    assert f1 == Fence(s1, 0, 0, 0)
    res = h.fails(OpenCall(), "resource_exhausted")
    assert res.error and res.error.retryable
    assert h.control.admissions == {"accepted": 2, "rejected": 1}


def test_append_commit_advance_turn_and_response() -> None:
    h = Harness()
    sid, f = h.open()
    h.ok(AppendCall(fence=f, lease_generation=1, audio=b"\0\0" * 10))
    res, eff = h.do(CommitCall(fence=f, lease_generation=1))
    assert res.accepted_fence == Fence(sid, 0, 1, 1)
    assert eff.start == [sid]
    job = h.control.next_job(sid)
    assert job is not None and job.audio == b"\0\0" * 10 and job.respond
    # respond-only commit (response.create) on the history: the turn stays, the response advances
    res = h.ok(CommitCall(fence=res.accepted_fence, lease_generation=1, respond=True))
    assert res.accepted_fence == Fence(sid, 0, 1, 2)


def test_error_codes() -> None:
    h = Harness(max_input_bytes=100, max_pending_turns=1)
    sid, f = h.open()
    h.fails(AppendCall(fence=Fence("sess_nope"), lease_generation=1, text="x"), "not_found")
    h.fails(AppendCall(fence=f, lease_generation=1), "invalid_argument")
    h.fails(AppendCall(fence=f, lease_generation=1, audio=b"\0"), "invalid_argument")
    h.fails(AppendCall(fence=f, lease_generation=1, audio=b"\0" * 102), "input_backpressure")
    h.fails(CommitCall(fence=f, lease_generation=1, respond=False), "input_audio_buffer_empty")
    h.fails(
        SignalCall(fence=f, lease_generation=1, event="response.cancel", next_fence=Fence(sid, 1)),
        "nothing_to_cancel",
    )
    h.fails(SignalCall(fence=f, lease_generation=1, event="barge_in"), "invalid_argument")
    h.fails(AppendCall(fence=f, lease_generation=1, text="x", expected_epoch=3), "stale_fence")
    h.ok(AppendCall(fence=f, lease_generation=1, text="hi"))
    f1 = h.ok(CommitCall(fence=f, lease_generation=1)).accepted_fence
    assert f1 is not None
    h.ok(AppendCall(fence=f1, lease_generation=1, text="again"))
    h.fails(CommitCall(fence=f1, lease_generation=1), "input_backpressure")
    h.fails(AppendCall(fence=f, lease_generation=1, text="old"), "stale_fence")
    h.fails(ResumeCall(session_id=sid, expected_lease_generation=7), "stale_lease")
    h.fails(TouchCall(fence=f1, lease_generation=1, activity="playback_ack"), "invalid_argument")


def test_stale_calls_change_nothing() -> None:
    h = Harness()
    sid, f = h.open()
    h.ok(AppendCall(fence=f, lease_generation=1, text="hello"))
    new = h.ok(CommitCall(fence=f, lease_generation=1)).accepted_fence
    session = h.control.sessions[sid]
    before = (session.fence, bytes(session.audio), list(session.text_parts), len(session.jobs))
    h.fails(AppendCall(fence=f, lease_generation=1, text="late"), "stale_fence")
    h.fails(CommitCall(fence=f, lease_generation=1), "stale_fence")
    h.fails(CloseCall(fence=f, lease_generation=1), "stale_fence")
    after = (session.fence, bytes(session.audio), list(session.text_parts), len(session.jobs))
    assert before == after and session.fence == new and session.state == "open"


def test_cancel_advances_epoch_and_never_goes_backwards() -> None:
    h = Harness()
    sid, f = h.open()
    h.ok(AppendCall(fence=f, lease_generation=1, text="hello"))
    f = h.ok(CommitCall(fence=f, lease_generation=1)).accepted_fence
    assert f is not None
    job = h.control.next_job(sid)
    res, eff = h.do(
        SignalCall(
            fence=f,
            lease_generation=1,
            event="barge_in",
            next_fence=Fence(sid, 1, f.turn_id, f.response_seq),
        )
    )
    assert res.ok and res.accepted_fence == Fence(sid, 1, 1, 1)
    assert len(eff.cancels) == 1
    cancel = eff.cancels[0]
    assert cancel.old_epoch == 0 and cancel.active is job and cancel.reason == "turn_detected"
    assert not h.control.is_current(f)
    # a late cancel (old fence) only cleans up its own epoch and moves nothing back
    res, eff = h.do(
        SignalCall(fence=f, lease_generation=1, event="response.cancel", next_fence=Fence(sid, 1))
    )
    assert res.ok and res.accepted_fence == Fence(sid, 1, 1, 1)
    assert [c.old_epoch for c in eff.cancels] == [0] and eff.cancels[0].active is None
    # input.cancel clears the uncommitted input
    f = res.accepted_fence
    h.ok(AppendCall(fence=f, lease_generation=1, audio=b"\0\0" * 4))
    h.ok(
        SignalCall(
            fence=f, lease_generation=1, event="input.cancel", next_fence=Fence(sid, 2, 1, 1)
        )
    )
    assert not h.control.sessions[sid].has_input()


def test_operation_id_dedup() -> None:
    h = Harness()
    sid, f = h.open()
    h.ok(AppendCall(fence=f, lease_generation=1, text="hi", operation_id="op1"))
    r1 = h.ok(CommitCall(fence=f, lease_generation=1, operation_id="op2"))
    again = h.ok(CommitCall(fence=f, lease_generation=1, operation_id="op2"))  # retry, old fence
    assert again.deduplicated and again.accepted_fence == r1.accepted_fence
    assert len(h.control.sessions[sid].jobs) == 1  # not resubmitted
    h.fails(
        AppendCall(fence=f, lease_generation=1, text="other", operation_id="op1"),
        "invalid_argument",
    )
    # cleared on a new epoch
    f1 = r1.accepted_fence
    assert f1 is not None
    h.ok(SignalCall(fence=f1, lease_generation=1, event="barge_in", next_fence=Fence(sid, 1, 1, 1)))
    assert not h.control.sessions[sid].ops


def test_append_seq_dedup() -> None:
    h = Harness()
    sid, f = h.open()
    h.ok(AppendCall(fence=f, lease_generation=1, audio=b"\1\0", seq=1))
    h.ok(AppendCall(fence=f, lease_generation=1, audio=b"\2\0", seq=2))
    res = h.ok(AppendCall(fence=f, lease_generation=1, audio=b"\2\0", seq=2))
    assert res.deduplicated
    assert bytes(h.control.sessions[sid].audio) == b"\1\0\2\0"


def test_resume_is_compare_and_swap() -> None:
    h = Harness()
    sid, f = h.open()
    h.ok(TouchCall(fence=f, lease_generation=1, activity="detach"))
    res = h.ok(ResumeCall(session_id=sid, expected_lease_generation=1))
    assert res.lease_generation == 2
    h.fails(ResumeCall(session_id=sid, expected_lease_generation=1), "stale_lease")
    # the old attachment is refused; the live session stays alone
    h.fails(AppendCall(fence=f, lease_generation=1, text="x"), "stale_fence")
    h.fails(CloseCall(fence=f, lease_generation=1), "stale_fence")
    assert h.control.sessions[sid].state == "open"
    assert h.control.sessions[sid].lease.detached_at is None
    h.ok(AppendCall(fence=f, lease_generation=2, text="x"))


def test_close_is_two_step_and_idempotent() -> None:
    h = Harness(max_sessions=1)
    sid, f = h.open()
    res, eff = h.do(CloseCall(fence=f, lease_generation=1))
    assert res.ok and eff.cleanups == [sid]
    h.fails(OpenCall(), "resource_exhausted")  # the slot is held until cleanup succeeded
    h.ok(CloseCall(fence=f, lease_generation=1))
    h.fails(AppendCall(fence=f, lease_generation=1, text="x"), "session_expired")
    eff = h.control.finish_close(sid)
    assert [e.event for e in eff.events] == [
        SessionLifecycle(session_id=sid, state="closed", reason="client")
    ]
    h.ok(CloseCall(fence=f, lease_generation=1))
    h.fails(ResumeCall(session_id=sid, expected_lease_generation=1), "session_expired")
    h.open()


def test_leases_idle_grace_inflight_and_warning() -> None:
    h = Harness(idle_ttl_s=10.0, disconnect_grace_s=3.0, expiring_warning_s=2.0)
    idle, _ = h.open()
    busy, fb = h.open()
    gone, fg = h.open()
    h.ok(AppendCall(fence=fb, lease_generation=1, text="q"))
    h.ok(CommitCall(fence=fb, lease_generation=1))
    h.control.next_job(busy)
    h.ok(TouchCall(fence=fg, lease_generation=1, activity="detach"))
    h.now = 1.5
    eff = h.control.tick(h.now, set())
    assert [(e.session_id, e.event.state) for e in eff.events] == [(gone, "expiring")]  # type: ignore[union-attr]
    assert h.control.tick(h.now, set()).events == []  # warned once
    h.now = 3.5
    eff = h.control.tick(h.now, set())
    assert eff.cleanups == [gone]
    assert any(
        isinstance(e.event, SessionLifecycle) and e.event.reason == "disconnected"
        for e in eff.events
    )
    h.now = 11.0
    eff = h.control.tick(h.now, {gone})
    assert eff.cleanups == [idle]  # busy has a turn in flight, gone's cleanup is running
    assert busy in h.control.sessions and h.control.sessions[busy].state == "open"


def test_playback_ack_truncates_and_clamps() -> None:
    h = Harness()
    sid, f = h.open()
    h.ok(AppendCall(fence=f, lease_generation=1, text="q"))
    f = h.ok(CommitCall(fence=f, lease_generation=1)).accepted_fence
    assert f is not None
    job = h.control.next_job(sid)
    assert job is not None
    hist = h.control.sessions[sid].history
    hist.add_user("q", 1)
    hist.start_assistant(1, 1)
    hist.append_assistant(1, 1, "Hello there. ", 0.0, 500.0)
    hist.append_assistant(1, 1, "How are you today? ", 500.0, 500.0)
    hist.finish_assistant(1, 1, "completed")
    h.control.job_done(sid, job, h.now)
    res = h.ok(
        TouchCall(
            fence=f,
            lease_generation=1,
            activity="playback_ack",
            playback=PlaybackMark(turn_id=1, response_seq=1, played_ms=5000),
        )
    )
    assert res.clamped_ms == 1000.0
    res = h.ok(
        TouchCall(
            fence=f,
            lease_generation=1,
            activity="playback_ack",
            playback=PlaybackMark(turn_id=1, response_seq=1, played_ms=500, truncate=True),
        )
    )
    assert res.clamped_ms == 500.0
    assert "How are you" not in hist.assistant_text(1, 1)
    h.fails(
        TouchCall(
            fence=f,
            lease_generation=1,
            activity="playback_ack",
            playback=PlaybackMark(turn_id=9, response_seq=9, played_ms=5),
        ),
        "invalid_argument",
    )


def test_session_update() -> None:
    h = Harness()
    sid, f = h.open()
    h.ok(
        SignalCall(
            fence=f,
            lease_generation=1,
            event="session.update",
            update=SessionUpdate(instructions="Be terse.", output_modalities=("text",)),
        )
    )
    cfg = h.control.sessions[sid].config
    assert cfg.instructions == "Be terse." and cfg.output_modalities == ("text",)
    h.fails(SignalCall(fence=f, lease_generation=1, event="session.update"), "invalid_argument")


@pytest.mark.parametrize("event", ["barge_in", "response.cancel", "input.cancel"])
def test_cancel_with_foreign_next_fence_is_refused(event: str) -> None:
    h = Harness()
    _, f = h.open()
    h.fails(
        SignalCall(
            fence=f,
            lease_generation=1,
            event=event,  # type: ignore[arg-type]
            next_fence=Fence("sess_other", 5),
        ),
        "invalid_argument",
    )


def test_item_delete_drops_uncommitted_queued_and_out_of_band_keeps_input() -> None:
    from duplex_contract.tools import ItemRef, ResponseOptions, ToolOutput

    h = Harness()
    sid, _ = h.open()
    session = h.control.sessions[sid]

    def append(text: str, item_id: str) -> None:
        h.ok(AppendCall(fence=session.fence, lease_generation=1, text=text, item_id=item_id))

    def delete(item_id: str) -> None:
        ref = ItemRef(item_id=item_id)
        h.ok(SignalCall(fence=session.fence, lease_generation=1, event="item.delete", item=ref))

    append("keep", "item_a")
    append("drop", "item_b")
    delete("item_b")  # not committed yet
    assert session.text_items == [("item_a", "keep")] and session.text_parts == ["keep"]
    # an out-of-band response leaves the input where it is and takes no turn
    oob = ResponseOptions(conversation="none")
    res = h.ok(CommitCall(fence=session.fence, lease_generation=1, respond=True, response=oob))
    assert session.text_items == [("item_a", "keep")] and res.accepted_fence is not None
    assert res.accepted_fence.turn_id == 0
    assert session.jobs[-1].response == oob and not session.jobs[-1].items
    session.jobs.clear()
    output = ToolOutput(call_id="call_1", name="f", output="{}", item_id="item_t")
    h.ok(AppendCall(fence=session.fence, lease_generation=1, tool_output=output))
    res = h.ok(CommitCall(fence=session.fence, lease_generation=1, respond=False))
    job = session.jobs[-1]
    assert job.items == (("item_a", "keep"),) and job.tool_outputs == (output,)
    delete("item_a")  # queued: gone from the job before it reaches the history
    assert job.items == () and job.text == ""
    delete("nothing")  # the engine holds nothing: not an error (the server decides)


def test_input_discard_drops_the_uncommitted_audio_and_keeps_the_epoch() -> None:
    """A backchannel taken back (the front end's interruption decision): its audio is
    dropped from the input, its live partials and pause guess go stale, the epoch stays,
    and text items stay."""
    h = Harness()
    sid, f = h.open()
    session = h.control.sessions[sid]
    h.ok(AppendCall(fence=f, lease_generation=1, text="keep", item_id="item_a"))
    h.ok(AppendCall(fence=f, lease_generation=1, audio=b"\1\0" * 160, stream_ms=2000.0))
    res, eff = h.do(SignalCall(fence=f, lease_generation=1, event="input.discard"))
    assert res.ok and res.accepted_fence == f  # no new epoch, turn or response
    assert session.audio == bytearray() and session.audio_stream_ms is None
    assert session.text_items == [("item_a", "keep")]
    assert eff.input_reset == [sid] and eff.unspeculate == [sid] and not eff.cancels
    # the next audio is a turn of its own
    h.ok(AppendCall(fence=f, lease_generation=1, audio=b"\2\0" * 80))
    h.ok(CommitCall(fence=f, lease_generation=1))
    job = h.control.next_job(sid)
    assert job is not None and job.audio == b"\2\0" * 80 and job.text == "keep"
