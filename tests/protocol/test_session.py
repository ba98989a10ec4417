"""The session state machine, driven with events and timestamps only (no sockets, no clock)."""

from __future__ import annotations

import pytest

from duplex_contract.errors import ControlError
from duplex_contract.fence import Fence
from duplex_contract.session_events import (
    AudioChunk,
    ResponseDone,
    ResponseStarted,
    SessionLifecycle,
    TextDelta,
    UserTranscript,
)
from duplex_server.protocol import events as ev
from duplex_server.protocol.commands import (
    Action,
    Append,
    Call,
    Cancel,
    CloseSocket,
    Commit,
    ConfigureInput,
    PurgeAudio,
    Send,
    SendAudio,
    Speculate,
    Touch,
)
from duplex_server.protocol.machine import SessionMachine
from duplex_server.protocol.session_config import EffectiveSession
from duplex_server.protocol.vad_events import VadPause, VadResume, VadStart, VadStop

SID = "sess_0123456789abcdef0123456789abcdef"
CHUNK = b"\x00\x01" * 320  # 20 ms at 16 kHz


def sent(actions: list[Action]) -> list[ev.ServerEvent]:
    return [a.event for a in actions if isinstance(a, Send)]


def types(actions: list[Action]) -> list[str]:
    return [type(e).__struct_config__.tag for e in sent(actions)]  # type: ignore[misc]


def calls(actions: list[Action]) -> list[object]:
    return [a.command for a in actions if isinstance(a, Call)]


def core(**kw: object) -> SessionMachine:
    c = SessionMachine(SID, EffectiveSession(**kw))  # type: ignore[arg-type]
    c.opened("tok", _caps())
    return c


def _caps() -> ev.Capabilities:
    return ev.Capabilities(True, True, ["pcm16"], ["pcm16"], ["server_vad"], "energy", 1, 1, 1.0)


def start_response(c: SessionMachine, now: float = 0.0) -> Fence:
    fence = Fence(SID, c.epoch, c.position.turn_id + 1, c.position.response_seq + 1)
    c.on_result(Commit(c.epoch, respond=True), fence)
    c.on_engine_event(ResponseStarted(fence=fence), now)
    return fence


def test_handshake_sends_session_created_and_configures_input() -> None:
    c = SessionMachine(SID, EffectiveSession())
    out = c.opened("tok", _caps())
    created = sent(out)[0]
    assert isinstance(created, ev.SessionCreated)
    assert created.session.id == SID and created.resume_token == "tok"
    assert created.session.audio.input.turn_detection is not None
    assert any(isinstance(a, ConfigureInput) for a in out)


def test_text_turn_in_order() -> None:
    c = core(output_modalities=("text",))
    item = ev.ItemParam(content=[ev.ContentPartParam(type="input_text", text="hi")])
    out = c.on_client_event(ev.ConversationItemCreate(item=item), 0)
    assert types(out) == ["conversation.item.added", "conversation.item.done"]
    # the item is input message 1 (implicitly numbered): the engine keeps the number
    assert calls(out) == [Append(0, text="hi", item_id="item_0123456789ab00001", seq=1)]
    out = c.on_client_event(ev.ResponseCreate(), 0)
    assert calls(out) == [Commit(0, respond=True)]
    fence = start_response(c)
    out = c.on_engine_event(TextDelta(fence=fence, text="Hello"), 1)
    assert types(out) == ["response.output_text.delta"]
    out = c.on_engine_event(ResponseDone(fence=fence, status="completed", text="Hello"), 2)
    assert types(out) == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "conversation.item.done",
        "response.done",
    ]
    done = sent(out)[-1]
    assert isinstance(done, ev.ResponseDone) and done.response.status == "completed"


def test_server_vad_turn_commits_and_transcribes_before_response() -> None:
    c = core()
    assert calls(c.on_input_audio(CHUNK * 10, [], 0)) == []  # idle audio waits in the ring
    out = c.on_input_audio(CHUNK, [VadStart(onset_ms=180.0, audio_start_ms=0.0)], 10)
    assert types(out) == ["input_audio_buffer.speech_started"]
    started_id = sent(out)[0].item_id  # type: ignore[attr-defined]
    appended = calls(out)
    assert len(appended) == 1 and isinstance(appended[0], Append)
    assert len(appended[0].audio) == len(CHUNK) * 11  # prefix padding came along
    out = c.on_input_audio(CHUNK, [VadStop(audio_end_ms=220.0)], 20)
    assert types(out) == [
        "input_audio_buffer.speech_stopped",
        "input_audio_buffer.committed",
        "conversation.item.added",
    ]
    commit = calls(out)[-1]
    assert isinstance(commit, Commit) and commit.respond and commit.item_id == started_id
    fence = Fence(SID, 0, 1, 1)
    c.on_result(commit, fence)
    out = c.on_engine_event(UserTranscript(fence=fence, text="what", final=True), 30)
    assert types(out)[-2:] == [
        "conversation.item.input_audio_transcription.completed",
        "conversation.item.done",
    ]


def _speak(c: SessionMachine, ms: int, now: float) -> list[Action]:
    out = c.on_input_audio(CHUNK, [VadStart(onset_ms=c.input.input_ms, audio_start_ms=0.0)], now)
    for _ in range(ms // 20):
        out += c.on_input_audio(CHUNK, [], now)
    return out


def test_barge_in_cancels_purges_and_drops_stale_audio() -> None:
    c = core()
    fence = start_response(c)
    chunk = AudioChunk(
        fence=fence,
        pcm=b"\0" * 4800,
        sample_rate=24000,
        audio_start_ms=0.0,
        duration_ms=100.0,
        text="Hello",
    )
    out = c.on_engine_event(chunk, 1)
    # the audio leaves as PCM with its place (the runtime encodes it: output_audio.delta)
    resp = c.responses.current
    assert resp is not None
    audio = SendAudio(resp.id, resp.item_id, 0, chunk.pcm, 24000, 0.0, 100.0)
    assert out[0] == audio
    assert types(out) == ["response.output_audio_transcript.delta"]
    out = _speak(c, 200, now=500)
    assert "response.done" in types(out) and "output_audio_buffer.cleared" in types(out)
    done = next(e for e in sent(out) if isinstance(e, ev.ResponseDone))
    assert done.response.status == "cancelled"
    assert done.response.status_details is not None
    assert done.response.status_details.reason == "turn_detected"
    assert PurgeAudio(1) in out
    assert Cancel(0, "barge_in") in calls(out)
    assert c.epoch == 1
    assert c.on_engine_event(chunk, 600) == []  # stale epoch: never an event


def test_false_barge_in_guards() -> None:
    td = ev.TurnDetection(min_interrupt_speech_ms=300, uninterruptible_ms=1000)
    c = core(turn_detection=td)
    start_response(c, now=0)
    out = _speak(c, 200, now=2000)  # too short
    assert not any(isinstance(x, Cancel) for x in calls(out))
    c2 = core(turn_detection=td)
    start_response(c2, now=0)
    out = _speak(c2, 400, now=500)  # long enough, but inside the uninterruptible window
    assert not any(isinstance(x, Cancel) for x in calls(out))
    out = c2.on_input_audio(CHUNK, [], 1200)  # still speaking after the window
    assert any(isinstance(x, Cancel) for x in calls(out))


def test_truncate_is_clamped_to_audio_sent() -> None:
    c = core()
    fence = start_response(c)
    chunk = AudioChunk(
        fence=fence,
        pcm=b"\0" * 4800,
        sample_rate=24000,
        audio_start_ms=0.0,
        duration_ms=100.0,
        text="Hi",
    )
    c.on_engine_event(chunk, 1)
    c.on_engine_event(ResponseDone(fence=fence, status="completed"), 2)
    item_id = c.items.last_item
    assert item_id is not None
    out = c.on_client_event(ev.ConversationItemTruncate(item_id=item_id, audio_end_ms=5000), 3)
    truncated = sent(out)[0]
    assert isinstance(truncated, ev.ItemTruncated)
    assert (truncated.audio_end_ms, truncated.requested_audio_end_ms) == (100, 5000)
    touch = calls(out)[0]
    assert isinstance(touch, Touch) and touch.playback is not None
    assert touch.playback.truncate and touch.playback.played_ms == 100.0


@pytest.mark.parametrize(
    ("event", "code"),
    [
        (ev.ResponseCancel(event_id="c1"), "response_cancel_not_active"),
        (ev.InputAudioBufferCommit(), "input_audio_buffer_commit_empty"),
        (ev.ConversationItemRetrieve(item_id="nope"), "item_not_found"),
        (ev.ConversationItemDelete(item_id="nope"), "item_not_found"),
        (ev.SessionUpdate(session=ev.SessionParam(speed=9.0)), "invalid_value"),
        (ev.SessionResume(session_id="s", resume_token="t"), "invalid_state"),
    ],
)
def test_client_errors_leave_the_session_unchanged(event: ev.AnyClientEvent, code: str) -> None:
    c = core()
    before = (c.epoch, c.config)
    out = c.on_client_event(event, 0)
    err = sent(out)[0]
    assert isinstance(err, ev.Error) and err.error.code == code
    assert err.error.event_id == event.event_id
    assert (c.epoch, c.config) == before


def test_second_response_create_is_refused() -> None:
    c = core()
    c.on_client_event(ev.ResponseCreate(), 0)
    out = c.on_client_event(ev.ResponseCreate(), 0)
    err = sent(out)[0]
    assert isinstance(err, ev.Error)
    assert err.error.code == "conversation_already_has_active_response"


def test_engine_failure_maps_to_error() -> None:
    c = core()
    cmd = Commit(0, respond=True)
    out = c.on_failure(cmd, ControlError("busy", code="input_backpressure"))
    err = sent(out)[0]
    assert isinstance(err, ev.Error) and err.error.code == "input_backpressure"
    assert not c.responses.active


def test_session_update_ga_and_beta_shapes() -> None:
    c = core()
    ga = ev.SessionParam(
        output_modalities=["text"],
        audio=ev.AudioParam(
            input=ev.AudioInputParam(
                format=ev.AudioFormatObj(type="audio/pcmu"), turn_detection=None
            )
        ),
    )
    out = c.on_client_event(ev.SessionUpdate(session=ga), 0)
    assert c.config.output_modalities == ("text",) and c.config.input_format.codec == "g711_ulaw"
    assert c.config.turn_detection is None
    assert any(isinstance(a, ConfigureInput) for a in out)
    beta = ev.SessionParam(
        modalities=["audio", "text"],
        input_audio_format="pcm16",
        voice="v",
        turn_detection=ev.TurnDetectionParam(silence_duration_ms=200),
    )
    c.on_client_event(ev.SessionUpdate(session=beta), 0)
    assert c.config.output_modalities == ("audio",) and c.config.voice == "v"
    assert c.config.turn_detection is not None
    assert c.config.turn_detection.silence_duration_ms == 200


def test_lifecycle_expiry_closes_with_1000() -> None:
    c = core()
    out = c.on_engine_event(SessionLifecycle(session_id=SID, state="expiring", in_s=5.0), 0)
    assert types(out) == ["session.expiring"]
    out = c.on_engine_event(SessionLifecycle(session_id=SID, state="expired", reason="idle"), 0)
    assert types(out) == ["session.expired", "session.closed"]
    assert CloseSocket(1000, "idle") in out


def test_transcript_that_overtakes_its_commit_reply_finds_its_item() -> None:
    c = core(turn_detection=None)
    c.on_input_audio(CHUNK * 5, [], 0)
    out = c.on_client_event(ev.InputAudioBufferCommit(), 0)
    item_id = sent(out)[0].item_id  # type: ignore[attr-defined]
    fence = Fence(SID, 0, 1, 0)
    out = c.on_engine_event(UserTranscript(fence=fence, text="hi", final=True), 1)
    done = sent(out)[1]
    assert isinstance(done, ev.InputTranscriptCompleted) and done.item_id == item_id
    commit = calls(c.on_client_event(ev.ResponseCreate(), 2))[0]
    assert commit == Commit(0, respond=True)


def test_vad_pause_speculates_after_all_speech_is_appended_and_resume_drops_it() -> None:
    c = core()
    c.on_input_audio(CHUNK, [VadStart(onset_ms=0.0, audio_start_ms=0.0)], 0)
    out = c.on_input_audio(CHUNK, [VadPause(at_ms=100.0)], 10)
    cmds = calls(out)
    assert [type(x).__name__ for x in cmds] == ["Append", "Speculate"]
    assert cmds[1] == Speculate(0, "input.pause")
    out = c.on_input_audio(CHUNK, [VadResume(at_ms=140.0)], 20)
    assert Speculate(0, "input.resume") in calls(out)
    # no speech in progress: a stray pause asks nothing of the engine
    c.on_input_audio(CHUNK, [VadStop(audio_end_ms=300.0)], 30)
    assert not [
        x
        for x in calls(c.on_input_audio(CHUNK, [VadPause(at_ms=400.0)], 40))
        if isinstance(x, Speculate)
    ]


def test_voice_interrupts_a_pending_response_silently() -> None:
    c = core()
    c.on_input_audio(CHUNK, [VadStart(onset_ms=0.0, audio_start_ms=0.0)], 0)
    out = c.on_input_audio(CHUNK, [VadStop(audio_end_ms=40.0)], 10)
    commit = calls(out)[-1]
    assert isinstance(commit, Commit) and commit.respond
    assert c.responses.active  # committed, its transcript and response not started yet
    out = _speak(c, 200, now=100)  # the user goes on after a short pause
    assert Cancel(0, "barge_in") in calls(out)
    assert "response.done" not in types(out)  # nothing had started: nothing to end
    assert not c.responses.active and c.epoch == 1


def test_a_whole_utterance_in_one_batch_still_interrupts() -> None:
    """Under load the input lane can hand over speech start and stop together."""
    c = core()
    start_response(c)
    out = c.on_input_audio(
        CHUNK * 20, [VadStart(onset_ms=0.0, audio_start_ms=0.0), VadStop(audio_end_ms=300.0)], 50
    )
    cmds = calls(out)
    assert Cancel(0, "barge_in") in cmds
    cancel_at = cmds.index(Cancel(0, "barge_in"))
    commit_at = next(i for i, x in enumerate(cmds) if isinstance(x, Commit))
    assert cancel_at < commit_at  # the old response ends before the new turn is committed
    # too short an utterance does not
    c2 = core()
    start_response(c2)
    out = c2.on_input_audio(
        CHUNK * 5, [VadStart(onset_ms=0.0, audio_start_ms=0.0), VadStop(audio_end_ms=60.0)], 50
    )
    assert not any(isinstance(x, Cancel) for x in calls(out))


def test_live_partials_are_deltas_of_the_speech_item() -> None:
    from duplex_contract.session_events import UserTranscript

    c = core()
    c.input.turns.speech_item = "item_live"  # speech in progress (as after a VAD onset)
    fence = c.position.fence

    def deltas(text: str) -> list[object]:
        out = c.on_engine_event(UserTranscript(fence=fence, text=text, final=False), 0)
        return [(e.item_id, e.delta) for e in sent(out) if isinstance(e, ev.InputTranscriptDelta)]

    assert deltas("ever") == [("item_live", "ever")]
    assert deltas("ever tried") == [("item_live", " tried")]
    assert deltas("ever tried") == []  # nothing new
    assert deltas("never tried") == []  # revised: the completed transcript settles it
    c.input.turns.speech_item = None
    assert deltas("ever tried again") == []  # no speech in progress


def _td_update(c: SessionMachine, **td: object) -> list[ev.ServerEvent]:
    param = ev.SessionParam(
        audio=ev.AudioParam(input=ev.AudioInputParam(turn_detection=ev.TurnDetectionParam(**td)))  # type: ignore[arg-type]
    )
    return sent(c.on_client_event(ev.SessionUpdate(session=param), 0))


def test_semantic_vad_settings_round_trip_and_bad_values() -> None:
    c = core()
    out = _td_update(c, type="semantic_vad", eagerness="high")
    updated = next(e for e in out if isinstance(e, ev.SessionUpdated))
    td = updated.session.audio.input.turn_detection
    assert td is not None and (td.type, td.eagerness) == ("semantic_vad", "high")
    assert td.silence_duration_ms == 1000  # high: the longest wait of an unfinished turn
    _td_update(c, type="semantic_vad")  # eagerness kept
    assert c.config.turn_detection is not None and c.config.turn_detection.eagerness == "high"
    _td_update(c, type="semantic_vad", eagerness="low", silence_duration_ms=2500)
    assert c.config.turn_detection.silence_duration_ms == 2500
    before = c.config
    for bad, param in (
        ({"type": "semantic_vad", "eagerness": "eager"}, "turn_detection.eagerness"),
        ({"type": "server_vad", "eagerness": "low"}, "turn_detection.eagerness"),
    ):
        out = _td_update(c, **bad)
        err = next(e for e in out if isinstance(e, ev.Error))
        assert err.error.code == "invalid_value" and err.error.param == param, err
        assert "eagerness" in err.error.message
        assert c.config == before  # nothing changed
    _td_update(c, type="server_vad")  # back to server VAD: its own defaults
    assert c.config.turn_detection is not None
    assert c.config.turn_detection.type == "server_vad"
    assert c.config.turn_detection.eagerness is None
    assert c.config.turn_detection.silence_duration_ms == 500


def test_end_of_turn_words_round_trips_and_is_semantic_vad_s() -> None:
    c = core()
    out = _td_update(c, type="semantic_vad", end_of_turn="words")
    updated = next(e for e in out if isinstance(e, ev.SessionUpdated))
    td = updated.session.audio.input.turn_detection
    assert td is not None and (td.type, td.end_of_turn, td.eagerness) == (
        "semantic_vad",
        "words",
        "auto",
    )
    _td_update(c, type="semantic_vad", eagerness="high")  # the judge is kept
    assert c.config.turn_detection is not None and c.config.turn_detection.end_of_turn == "words"
    _td_update(c, type="semantic_vad", end_of_turn="audio")
    assert c.config.turn_detection.end_of_turn == "audio"
    before = c.config
    out = _td_update(c, type="server_vad", end_of_turn="words")
    err = next(e for e in out if isinstance(e, ev.Error))
    assert err.error.code == "invalid_value" and err.error.param == "turn_detection.end_of_turn"
    assert c.config == before
    _td_update(c, type="server_vad")
    assert c.config.turn_detection is not None and c.config.turn_detection.end_of_turn is None
    _td_update(c, type="semantic_vad")  # a new semantic_vad judges by the audio
    assert c.config.turn_detection.end_of_turn == "audio"


def _words_core() -> SessionMachine:
    c = core()
    _td_update(c, type="semantic_vad", end_of_turn="words", eagerness="high")
    c.on_input_audio(CHUNK, [VadStart(onset_ms=0.0, audio_start_ms=0.0)], 0)
    return c


def _guess(c: SessionMachine, n: int, text: str) -> list[Action]:
    fence = c.position.fence
    return c.on_engine_event(UserTranscript(fence=fence, text=text, final=False, guess=n), 0)


def test_end_of_turn_words_asks_a_pause_s_words_and_ends_the_turn_at_that_pause() -> None:
    from duplex_server.protocol.commands import EndTurn, JudgeWords

    c = _words_core()
    out = c.on_input_audio(CHUNK, [VadPause(at_ms=120.0)], 10)
    assert Speculate(0, "input.pause", words=1) in calls(out)
    out = _guess(c, 1, "What color is grass?")
    assert out == [JudgeWords(1, "What color is grass?", "high")]  # not shown as a partial
    assert c.input.words_judged(1, False) == []  # unfinished: the silence window decides
    assert c.input.words_judged(1, True) == [EndTurn(120.0)]
    # speech came back: that pause's words and verdict are stale
    out = c.on_input_audio(CHUNK, [VadResume(at_ms=200.0)], 20)
    assert Speculate(0, "input.resume") in calls(out)
    assert _guess(c, 1, "What color") == []
    assert c.input.words_judged(1, True) == []
    out = c.on_input_audio(CHUNK, [VadPause(at_ms=400.0)], 30)
    assert Speculate(0, "input.pause", words=2) in calls(out)
    assert _guess(c, 1, "What color") == []  # an older guess's words
    assert _guess(c, 2, "What color is grass?") != []
    # the turn ended (the silence window, or the verdict through the lane): nothing pending
    c.on_input_audio(CHUNK, [VadStop(audio_end_ms=380.0)], 40)
    assert _guess(c, 2, "What color is grass?") == []
    assert c.input.words_judged(2, True) == []


def test_without_end_of_turn_words_a_pause_asks_no_words() -> None:
    c = core()
    _td_update(c, type="semantic_vad")
    c.on_input_audio(CHUNK, [VadStart(onset_ms=0.0, audio_start_ms=0.0)], 0)
    out = c.on_input_audio(CHUNK, [VadPause(at_ms=120.0)], 10)
    assert Speculate(0, "input.pause") in calls(out)  # words=None
    assert _guess(c, 1, "What color is grass?") == []
