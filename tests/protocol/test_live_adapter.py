"""The GPT-Live adapter on the shared session core (protocol/live_adapter.py,
live_delegation.py, live_backend.py), driven with events and timestamps only: what the
core's Realtime actions become on the Live wire, delegation in both modes, the floor,
usage, expiry, close and failover state."""

from __future__ import annotations

import base64
import json
from typing import Any

import msgspec

from duplex_contract.batch import BatchDone, CallOut, ChatJob, TextOut
from duplex_contract.fence import Fence
from duplex_contract.session_events import (
    AudioChunk,
    FunctionCallDone,
    ResponseDone,
    ResponseStarted,
    UserTranscript,
)
from duplex_contract.tools import TOOL_RESULT_MARK
from duplex_server.protocol import events as ev
from duplex_server.protocol.commands import (
    Action,
    Append,
    Call,
    Cancel,
    CloseSocket,
    Commit,
    ConfigureInput,
    ProcessAudio,
    Send,
    SendAudio,
    SendStamped,
)
from duplex_server.protocol.live_adapter import LiveAdapter
from duplex_server.protocol.live_config import LiveOptions, effective_session, parse_start
from duplex_server.protocol.live_delegation import ACK_NOTE, RunBackend, Step, StopBackends
from duplex_server.protocol.live_events import (
    LiveDelegationCreated,
    LiveError,
    LiveInfo,
    LiveInputTranscript,
    LiveMark,
    LiveResponseEvent,
    LiveSessionClosed,
    LiveSessionConfig,
    LiveSessionStarted,
    LiveUsageUpdated,
)
from duplex_server.protocol.machine import SessionMachine
from duplex_server.protocol.session_config import EffectiveSession
from duplex_server.protocol.vad_events import VadStart, VadStop
from tests.protocol.test_session import SID, _caps

CHUNK = b"\x00\x01" * 320  # 20 ms at 16 kHz
BACKEND = {
    "model": "b",
    "tools": [{"type": "function", "name": "lookup", "parameters": {"type": "object"}}],
}


def _live(session: dict[str, Any] | None = None, **opts: Any) -> tuple[SessionMachine, LiveAdapter]:
    cfg = msgspec.convert({"model": "gpt-live-1", **(session or {})}, LiveSessionConfig)
    options = LiveOptions(**opts)
    start = parse_start(
        cfg,
        options=options,
        default_instructions="be nice",
        served_model="duplex",
        voices=None,
        websocket=True,
    )
    core = SessionMachine(SID, effective_session(start, EffectiveSession(), options))
    adapter = LiveAdapter(core, start, options, now_ms=0.0, unix_s=1000.0)
    return core, adapter


def _run(a: LiveAdapter, steps: list[Step], now: float = 0.0) -> tuple[list[Any], list[Any]]:
    """The adapter's steps as the runtime carries them out: the core's actions through
    ``translate``, beside the runtime's own work."""
    actions = [s for s in steps if not isinstance(s, RunBackend | StopBackends)]
    work = [s for s in steps if isinstance(s, RunBackend | StopBackends)]
    out, more = a.translate(actions, now)
    return out, work + more


def _events(out: list[Action]) -> list[ev.ServerEvent]:
    return [x.event for x in out if isinstance(x, Send)]


def _calls(out: list[Action]) -> list[object]:
    return [x.command for x in out if isinstance(x, Call)]


def _response(c: SessionMachine, now: float = 0.0) -> Fence:
    fence = Fence(SID, c.epoch, c.position.turn_id + 1, c.position.response_seq + 1)
    c.on_result(Commit(c.epoch, respond=True), fence)
    c.on_engine_event(ResponseStarted(fence=fence), now)
    return fence


def _delegate(c: SessionMachine, a: LiveAdapter, now: float = 10.0) -> tuple[list[Any], list[Any]]:
    """The thinker calls ``delegate``; its response ends."""
    c.responses.requested()
    fence = _response(c, now)
    args = '{"task": "find my order"}'
    out = c.on_engine_event(
        FunctionCallDone(fence=fence, call_id="call_1", name="delegate", arguments=args), now
    )
    out += c.on_engine_event(ResponseDone(fence=fence, status="completed"), now)
    return _run(a, list(out), now)


# ---------------------------------------------------------------------------- the wire out
def test_open_speech_and_transcripts_become_live_events() -> None:
    c, a = _live()
    out, _ = _run(a, list(c.opened("tok", _caps())))
    started = _events(out)[0]
    assert isinstance(started, LiveSessionStarted) and started.resume_token == f"{SID}.tok"
    assert started.session.expires_at == 1000 + 7200 and started.session.status == "active"
    assert any(isinstance(x, ConfigureInput) for x in out)
    steps = c.on_input_audio(CHUNK * 10, [], 0)
    steps += c.on_input_audio(CHUNK, [VadStart(onset_ms=200.0, audio_start_ms=100.0)], 10)
    steps += c.on_input_audio(CHUNK, [VadStop(audio_end_ms=900.0)], 20)
    out, _ = _run(a, list(steps))
    assert _events(out) == []  # the wire has no turn events
    assert [type(x) for x in _calls(out)] == [Append, Append, Commit]
    fence = Fence(SID, 0, 1, 0)
    out, _ = _run(
        a, c.on_engine_event(UserTranscript(fence=fence, text="hi there", final=True), 30)
    )
    assert _events(out) == [LiveInputTranscript(delta="hi there", start_ms=100, end_ms=900)]


def test_reply_audio_stays_audio_and_its_text_becomes_a_mark() -> None:
    c, a = _live()
    c.opened("tok", _caps())
    c.responses.requested()
    fence = _response(c)
    chunk = AudioChunk(
        fence=fence,
        pcm=b"\0" * 4800,
        sample_rate=24000,
        audio_start_ms=300.0,
        duration_ms=100.0,
        text="Hello",
    )
    out, _ = _run(a, c.on_engine_event(chunk, 1))
    assert isinstance(out[0], SendAudio)
    resp = c.responses.current
    assert resp is not None
    assert _events(out) == [LiveMark(item_id=resp.item_id, start_ms=300.0, text="Hello")]
    out, _ = _run(a, c.on_engine_event(ResponseDone(fence=fence, status="completed"), 2))
    assert [type(e).__name__ for e in _events(out)] == ["AudioDone"]  # for the pacer only


def test_a_barge_in_reaches_the_transport_as_a_clear_and_nothing_else() -> None:
    c, a = _live()
    c.opened("tok", _caps())
    c.responses.requested()
    _response(c)
    steps = c.on_input_audio(CHUNK, [VadStart(onset_ms=c.input.input_ms, audio_start_ms=0.0)], 100)
    for _ in range(10):
        steps += c.on_input_audio(CHUNK, [], 300)
    out, _ = _run(a, list(steps))
    # the cancelled answer's audio is done, and the transport is to clear what it holds
    assert [type(e).__name__ for e in _events(out)] == ["AudioDone", "OutputAudioCleared"]
    assert Cancel(0, "barge_in") in _calls(out)


def test_errors_replays_and_resumes_on_the_live_wire() -> None:
    c, a = _live()
    c.opened("tok", _caps())
    out, _ = _run(
        a, a.on_text('{"type":"session.commentary.append","content":"x","event_id":"e9"}', 0)
    )
    err = _events(out)[0]
    assert isinstance(err, LiveError) and err.client_event_id == "e9"
    assert (err.error.code, err.error.param) == ("missing_required_parameter", "delegation_id")
    frames = (b'{"type":"session.input_transcript.delta","delta":"a"}', b'{"type":"response.done"}')
    out, _ = _run(a, [SendStamped(frames)])
    assert out == [SendStamped(frames[:1])]
    resumed = ev.SessionResumed(
        session_id=SID, resume_token="new", replayed=1, lease_generation=2, last_input_seq=0
    )
    out, _ = _run(a, [Send(resumed)])
    info = _events(out)[0]
    assert isinstance(info, LiveInfo) and info.code == "session.resumed"
    assert info.resume_token == f"{SID}.new"


# ---------------------------------------------------------------------------- client events
def test_muted_audio_reaches_the_model_as_silence_of_the_same_length() -> None:
    for fmt, fill in ((None, 0), ({"type": "audio/pcmu", "rate": 8000}, 0xFF)):
        c, a = _live({"audio": {"format": fmt}} if fmt else None)
        c.opened("tok", _caps())
        a.on_text('{"type":"session.input_audio.mute"}', 0)
        audio = base64.b64encode(b"\x10\x20" * 50).decode()
        out, _ = _run(a, a.on_text(f'{{"type":"session.input_audio.append","audio":"{audio}"}}', 0))
        assert out == [ProcessAudio(bytes([fill]) * 100)]
        a.on_text('{"type":"session.input_audio.unmute"}', 0)
        out, _ = _run(a, a.on_text(f'{{"type":"session.input_audio.append","audio":"{audio}"}}', 0))
        assert out == [ProcessAudio(b"\x10\x20" * 50)]


def test_client_delegation_commentary_is_the_calls_output_said_when_the_floor_is_free() -> None:
    c, a = _live({"delegation": {"type": "client", "acknowledgement_delay_ms": 500}})
    c.opened("tok", _caps())
    out, work = _delegate(c, a, now=10.0)
    created = next(e for e in _events(out) if isinstance(e, LiveDelegationCreated))
    d = created.delegation
    assert d.target == "client" and work == []
    out, _ = _run(a, a.tick(100.0, 1001.0), 100.0)
    assert _calls(out) == []  # the acknowledgement waits out its delay
    out, _ = _run(a, a.tick(600.0, 1001.0), 600.0)
    ack = _calls(out)
    assert len(ack) == 1 and isinstance(ack[0], Commit) and ack[0].response is not None
    assert (
        ACK_NOTE in (ack[0].response.instructions or "") and ack[0].response.tool_choice == "none"
    )
    fence = _response(c, 700.0)  # the acknowledgement is being said
    commentary = {"content": "It ships today.", "delegation_id": d.id}
    text = json.dumps({"type": "session.commentary.append", **commentary})
    out, _ = _run(a, a.on_text(text, 800.0), 800.0)
    appends = _calls(out)
    assert len(appends) == 1 and isinstance(appends[0], Append)
    assert appends[0].tool_output is not None and appends[0].tool_output.call_id == "call_1"
    assert appends[0].tool_output.output == "It ships today."
    assert "session.commentary.appended" in [type(e).__struct_config__.tag for e in _events(out)]
    out, _ = _run(a, a.tick(900.0, 1001.0))
    assert _calls(out) == []  # the floor is taken: a response is in progress
    c.on_engine_event(ResponseDone(fence=fence, status="completed"), 950.0)
    out, _ = _run(a, a.tick(1000.0, 1001.0))
    said = _calls(out)
    assert said == [Commit(0, respond=True)]  # the model says it in its own words
    bad = '{"type":"session.thinking.append","content":"x","delegation_id":"deleg_x"}'
    err = _events(_run(a, a.on_text(bad, 0))[0])[0]
    assert isinstance(err, LiveError) and err.error.param == "delegation_id"
    err = _events(_run(a, a.on_text('{"type":"response.create"}', 0))[0])[0]
    assert isinstance(err, LiveError) and err.error.code == "invalid_state"


def test_any_append_cancels_the_pending_acknowledgement() -> None:
    c, a = _live({"delegation": {"type": "client", "acknowledgement_delay_ms": 1000}})
    c.opened("tok", _caps())
    _delegate(c, a)
    a.on_text('{"type":"session.thinking.append","content":"later","delegation_id":null}', 20.0)
    out, _ = _run(a, a.tick(5000.0, 1001.0))
    assert _calls(out) == []  # no acknowledgement any more


def test_responses_delegation_runs_the_backend_and_waits_for_function_outputs() -> None:
    c, a = _live(
        {"delegation": {"type": "responses", "responses": BACKEND}}, backend_route="delegate"
    )
    c.opened("tok", _caps())
    out, work = _delegate(c, a)
    created = next(e for e in _events(out) if isinstance(e, LiveDelegationCreated))
    d = created.delegation
    assert d.target == "responses" and d.response_id
    (run,) = work
    assert isinstance(run, RunBackend) and run.delegation_id == d.id
    job: ChatJob = run.job
    assert job.route == "delegate" and [t.name for t in job.tools] == ["lookup"]
    assert [m.role for m in job.messages] == ["system", "user"]
    assert job.messages[1].content == "find my order" and "lookup" in job.messages[0].content
    kinds = [e.event["type"] for e in _events(out) if isinstance(e, LiveResponseEvent)]
    assert kinds == ["response.created"]
    call = '{"name": "lookup", "arguments": {"id": 7}}'
    out, _ = _run(a, a.on_backend(d.id, CallOut(request_id="r", text=call), 20.0))
    assert _events(out) == []  # a call's events come once it is whole
    ack = _calls(out)  # the floor was free: the acknowledgement (no delay) is said
    assert len(ack) == 1 and isinstance(ack[0], Commit) and ack[0].response is not None
    done = BatchDone(request_id="r", prompt_tokens=40, completion_tokens=9)
    out, _ = _run(a, a.on_backend(d.id, done, 30.0))
    events = [e.event for e in _events(out) if isinstance(e, LiveResponseEvent)]
    assert [e["type"] for e in events] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    fc = events[-2]["item"]
    assert fc["name"] == "lookup" and fc["arguments"] == '{"id":7}'
    assert events[-1]["response"]["usage"]["total_tokens"] == 49
    err = _events(_run(a, a.on_text('{"type":"response.create"}', 40.0))[0])[0]
    assert isinstance(err, LiveError) and err.error.code == "function_call_outputs_required"
    output = {"type": "function_call_output", "call_id": fc["call_id"], "output": "shipped"}
    item = json.dumps({"type": "response.item.create", "item": output})
    assert _run(a, a.on_text(item, 41.0)) == ([], [])
    out, work = _run(a, a.on_text('{"type":"response.create"}', 42.0))
    (run,) = work
    assert isinstance(run, RunBackend)
    note = run.job.messages[-1]
    assert note.role == "system" and TOOL_RESULT_MARK + "shipped" in note.content
    out, _ = _run(a, a.on_backend(d.id, TextOut(request_id="r", text="It shipped."), 50.0))
    kinds = [e.event["type"] for e in _events(out) if isinstance(e, LiveResponseEvent)]
    assert kinds == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    out, _ = _run(a, a.on_backend(d.id, BatchDone(request_id="r"), 60.0))
    appends = [x for x in _calls(out) if isinstance(x, Append)]
    assert appends and appends[0].tool_output is not None
    assert (
        appends[0].tool_output.output == "It shipped."
        and appends[0].tool_output.call_id == "call_1"
    )
    commentary = f'{{"type":"session.commentary.append","content":"x","delegation_id":"{d.id}"}}'
    err = _events(_run(a, a.on_text(commentary, 70.0))[0])[0]
    assert isinstance(err, LiveError) and err.error.code == "invalid_value"


def test_a_failed_backend_call_is_reported_and_the_thinker_is_told() -> None:
    c, a = _live({"delegation": {"type": "responses", "responses": BACKEND}})
    c.opened("tok", _caps())
    out, _ = _delegate(c, a)
    d = next(e for e in _events(out) if isinstance(e, LiveDelegationCreated)).delegation
    out, _ = _run(a, a.backend_failed(d.id, "stage_failed", "the model broke", 20.0))
    failed = [e.event for e in _events(out) if isinstance(e, LiveResponseEvent)]
    assert failed[0]["type"] == "response.failed"
    assert failed[0]["response"]["error"]["code"] == "stage_failed"
    appends = [x for x in _calls(out) if isinstance(x, Append)]
    assert appends and "could not finish" in (
        appends[0].tool_output.output if appends[0].tool_output else ""
    )


# ---------------------------------------------------------------------------- time and the end
def test_usage_ticks_expiry_and_close() -> None:
    c, a = _live(usage_interval_s=2.0, max_session_s=60.0)
    c.opened("tok", _caps())
    assert _events(_run(a, a.tick(1000.0, 1001.0))[0]) == []
    (usage,) = _events(_run(a, a.tick(2500.0, 1002.5))[0])
    assert isinstance(usage, LiveUsageUpdated) and usage.usage.seconds == 2.5
    out, work = _run(a, a.on_text('{"type":"session.close"}', 3000.0), 3000.0)
    assert any(isinstance(w, StopBackends) for w in work)
    last, closed = _events(out)
    assert isinstance(last, LiveUsageUpdated) and last.usage.seconds == 3.0
    assert isinstance(closed, LiveSessionClosed) and closed.reason == "close_requested"
    assert any(isinstance(x, CloseSocket) for x in out)
    c2, a2 = _live(max_session_s=60.0)
    c2.opened("tok", _caps())
    out, _ = _run(a2, a2.tick(61_000.0, 1060.0), 61_000.0)
    closed = _events(out)[-1]
    assert isinstance(closed, LiveSessionClosed) and closed.reason == "expired"


def test_a_dropped_transport_stops_the_answer_and_holds_the_floor() -> None:
    c, a = _live({"delegation": {"type": "client"}})
    c.opened("tok", _caps())
    c.responses.requested()
    _response(c)
    out, _ = _run(a, a.dropped(100.0))
    assert Cancel(0, "barge_in") in _calls(out) and not a.attached
    assert not a.free()
    a.attached = True
    assert a.free()


def test_failover_state_round_trips() -> None:
    c, a = _live({"delegation": {"type": "responses", "responses": BACKEND}}, max_session_s=100.0)
    rebuilt = LiveAdapter.restore(c, a.state(), LiveOptions(), now_ms=50_000.0, unix_s=1030.0)
    assert rebuilt.start == a.start and rebuilt.expires_at == a.expires_at == 1100
    assert rebuilt.started_ms == 20_000.0  # 30 s into the session
    assert rebuilt.delegations.backend == a.delegations.backend


def _audio(item_id: str, at: float, *, restart: bool = False) -> SendAudio:
    return SendAudio(
        response_id="r1",
        item_id=item_id,
        epoch=0,
        pcm=b"\0" * 4800,
        sample_rate=24000,
        audio_start_ms=at,
        duration_ms=100.0,
        restart=restart,
    )


def test_a_paused_answers_end_waits_for_the_audio_its_resume_sends_again() -> None:
    # ``interruption: confirm``: while an item is paused the core holds its audio but not
    # its end; the transport reads the end as "all its audio is known" (and releases its
    # words by it), so the end is held until the resume sent the audio again, or the
    # pause ended in a stop (after the clear, which drops the words)
    c, a = _live()
    paused = Send(ev.OutputAudioPaused(response_id="r1", item_id="i1"))
    done = Send(ev.AudioDone(response_id="r1", item_id="i1"))
    resumed = Send(ev.OutputAudioResumed(response_id="r1", item_id="i1", audio_start_ms=500.0))
    out, _ = a.translate([paused], 0.0)
    assert out == [paused]
    out, _ = a.translate([done], 1.0)  # the answer was all made meanwhile
    assert out == []
    again: list[Action] = [_audio("i1", 500.0, restart=True), _audio("i1", 600.0)]
    out, _ = a.translate([resumed, *again], 2.0)
    assert out == [*again, done]  # (the wire has no resumed event)
    out, _ = a.translate([done], 3.0)  # not paused now: as it comes
    assert out == [done]
    # paused again, ended, then stopped: the end follows the clear
    cleared = Send(ev.OutputAudioCleared(response_id="r1"))
    a.translate([paused], 4.0)
    assert a.translate([done], 5.0)[0] == []
    out, _ = a.translate([cleared], 6.0)
    assert out == [cleared, done]
    # resumed before the pause's flush was reported: the audio comes with the flush's
    # report (a later batch), and the end after it
    a.translate([paused], 7.0)
    a.translate([done], 8.0)
    c.playout.resume_pending = lambda item_id: True  # type: ignore[method-assign]
    out, _ = a.translate([resumed], 9.0)
    assert out == []
    out, _ = a.translate(again, 10.0)
    assert out == [*again, done]
