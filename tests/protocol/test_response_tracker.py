"""The response tracker alone (protocol/response_tracker.py and response_options.py): engine
output -> response events, response.create / cancel, the cancel's epoch step and the
barge-in decision, with its collaborators built by hand (no session machine)."""

from __future__ import annotations

import pytest

from duplex_contract.fence import Fence
from duplex_contract.session_events import AudioChunk, ResponseDone, ResponseStarted, TextDelta
from duplex_server.protocol import events as ev
from duplex_server.protocol.commands import (
    Action,
    Call,
    Cancel,
    Commit,
    PurgeAudio,
    Send,
    SendAudio,
    Touch,
)
from duplex_server.protocol.errors import ProtocolError
from duplex_server.protocol.items import Conversation
from duplex_server.protocol.playout import Playout, Queued
from duplex_server.protocol.position import EnginePosition
from duplex_server.protocol.response_options import response_options
from duplex_server.protocol.response_tracker import ResponseTracker
from duplex_server.protocol.session_config import EffectiveSession
from duplex_server.protocol.timeline import TurnTimeline
from duplex_server.protocol.usage import UsageMeter

SID = "sess_0123456789abcdef0123456789abcdef"
CFG = EffectiveSession()


def tracker() -> ResponseTracker:
    return ResponseTracker(
        EnginePosition(SID), Conversation(SID), UsageMeter(), TurnTimeline(), Playout()
    )


def sent(out: list[Action]) -> list[ev.ServerEvent]:
    return [a.event for a in out if isinstance(a, Send)]


def calls(out: list[Action]) -> list[object]:
    return [a.command for a in out if isinstance(a, Call)]


def started(t: ResponseTracker, now: float = 0.0, cfg: EffectiveSession = CFG) -> Fence:
    fence = Fence(SID, t.position.epoch, 1, 1)
    t.requested()
    t.on_engine_event(ResponseStarted(fence=fence), cfg, now)
    return fence


def test_response_create_commits_with_its_options_and_refuses_a_second() -> None:
    t = tracker()
    param = ev.ResponseParam(instructions="short", output_modalities=["text"])
    out = t.on_client_event(ev.ResponseCreate(response=param, event_id="e1"), CFG, 0)
    (commit,) = calls(out)
    assert isinstance(commit, Commit) and commit.respond and commit.event_id == "e1"
    assert commit.response is not None and commit.response.output_modalities == ("text",)
    assert t.active
    with pytest.raises(ProtocolError) as info:
        t.on_client_event(ev.ResponseCreate(), CFG, 0)
    assert info.value.code == "conversation_already_has_active_response"
    with pytest.raises(ProtocolError):
        t.on_client_event(ev.ResponseCreate(), EffectiveSession(session_type="transcription"), 0)


def test_bad_response_options_are_refused_naming_the_field() -> None:
    for param, field in (
        (ev.ResponseParam(conversation="other"), "response.conversation"),
        (ev.ResponseParam(output_modalities=[]), "response.output_modalities"),
        (ev.ResponseParam(max_output_tokens=0), "response.max_output_tokens"),
    ):
        with pytest.raises(ProtocolError) as info:
            response_options(param, (), {})
        assert info.value.param == field
    assert response_options(None, (), {}) == (None, None)


def test_audio_leaves_as_pcm_and_is_recorded_as_emitted() -> None:
    t = tracker()
    fence = started(t)
    resp = t.current
    assert resp is not None
    pcm = b"\x01\x00" * 2400  # 100 ms at 24 kHz
    chunk = AudioChunk(fence, pcm, 24000, audio_start_ms=0.0, duration_ms=100.0, text="Hi")
    out = t.on_engine_event(chunk, CFG, 5)
    assert out[0] == SendAudio(resp.id, resp.item_id, 0, pcm, 24000, 0.0, 100.0)
    assert sent(out) == [ev.TranscriptDelta(response_id=resp.id, item_id=resp.item_id, delta="Hi")]
    t.playout.report(Queued(resp.item_id))
    assert t.playout.playing() == resp.id
    position = t.playout.position()
    assert position is not None and position.emitted_ms == 100.0
    assert resp.moments["first_audio"] == 5


def test_a_cancel_ends_the_response_advances_the_epoch_and_purges() -> None:
    t = tracker()
    started(t)
    resp = t.current
    assert resp is not None
    out = t.cancel("response.cancel", "client_cancelled", "e9", 50)
    done = [e for e in sent(out) if isinstance(e, ev.ResponseDone)]
    assert done[0].response.status == "cancelled"
    assert ev.OutputAudioCleared(response_id=resp.id) in sent(out)
    assert PurgeAudio(1) in out and Cancel(0, "response.cancel", event_id="e9") in calls(out)
    assert t.position.epoch == 1 and not t.active
    # with nothing in progress a cancel still steps the epoch (input.cancel drops the turn)
    out = t.cancel("input.cancel", "input_cancelled", None, 60)
    assert sent(out) == [] and t.position.epoch == 2


def test_barge_in_follows_the_guards_on_a_response_in_progress() -> None:
    td = ev.TurnDetection(min_interrupt_speech_ms=300, uninterruptible_ms=1000)
    t = tracker()
    started(t, now=0)
    assert t.barge_in(td, 200, 2000) == []  # too short
    assert t.barge_in(td, 400, 500) == []  # inside the uninterruptible window
    assert Cancel(0, "barge_in") in calls(t.barge_in(td, 400, 1500))
    assert t.barge_in(td, 400, 1600) == []  # nothing in progress, nothing playing


def test_text_output_and_the_response_done() -> None:
    t = tracker()
    cfg = EffectiveSession(output_modalities=("text",))
    fence = started(t, cfg=cfg)
    out = t.on_engine_event(TextDelta(fence=fence, text="Hello"), cfg, 1)
    assert [type(e) for e in sent(out)] == [ev.TextDelta]
    out = t.on_engine_event(ResponseDone(fence=fence, status="completed"), cfg, 2)
    done = sent(out)[-1]
    assert isinstance(done, ev.ResponseDone) and done.response.status == "completed"
    assert not t.active and t.usage.total().responses == 1


def test_heard_clamps_to_the_audio_sent_and_refuses_an_unknown_item() -> None:
    t = tracker()
    fence = started(t)
    resp = t.current
    assert resp is not None
    chunk = AudioChunk(fence, b"\0" * 4800, 24000, audio_start_ms=0.0, duration_ms=100.0)
    t.on_engine_event(chunk, CFG, 1)
    out = t.heard(resp.item_id, 250.0, "e1", truncate=False)  # in progress: its audio so far
    ack = sent(out)[0]
    assert isinstance(ack, ev.PlaybackAcknowledged)
    assert (ack.played_ms, ack.requested_played_ms) == (100.0, 250.0)
    (touch,) = calls(out)
    assert isinstance(touch, Touch) and touch.event_id == "e1"
    assert touch.playback is not None and not touch.playback.truncate
    with pytest.raises(ProtocolError):
        t.heard("item_nope", 1.0, None, truncate=True)
