"""The client input handler alone (protocol/client_input.py): appends, commits, clears,
items, session.update, DTMF, live transcripts and the idle timeout, with its collaborators
built by hand (no session machine)."""

from __future__ import annotations

import base64

import pytest

from duplex_contract.fence import Fence
from duplex_contract.session_events import ResponseStarted, UserTranscript
from duplex_server.protocol import events as ev
from duplex_server.protocol.client_input import ClientInput
from duplex_server.protocol.commands import (
    Action,
    Append,
    Call,
    Cancel,
    Commit,
    ConfigureInput,
    DeleteItem,
    ProcessAudio,
    Send,
    Update,
)
from duplex_server.protocol.errors import ProtocolError
from duplex_server.protocol.input_seq import InputSequence
from duplex_server.protocol.items import Conversation
from duplex_server.protocol.playout import Playout
from duplex_server.protocol.position import EnginePosition
from duplex_server.protocol.response_tracker import ResponseTracker
from duplex_server.protocol.session_config import EffectiveSession
from duplex_server.protocol.timeline import TurnTimeline
from duplex_server.protocol.usage import UsageMeter
from duplex_server.protocol.vad_events import VadStart, VadStop

SID = "sess_0123456789abcdef0123456789abcdef"
CFG = EffectiveSession()
MANUAL = EffectiveSession(turn_detection=None)
CHUNK = b"\x01\x00" * 320  # 20 ms at 16 kHz


def handler() -> ClientInput:
    position, items, usage, timeline = (
        EnginePosition(SID),
        Conversation(SID),
        UsageMeter(),
        TurnTimeline(),
    )
    responses = ResponseTracker(position, items, usage, timeline, Playout())
    return ClientInput(SID, position, items, InputSequence(), usage, timeline, responses)


def sent(out: list[Action]) -> list[ev.ServerEvent]:
    return [a.event for a in out if isinstance(a, Send)]


def calls(out: list[Action]) -> list[object]:
    return [a.command for a in out if isinstance(a, Call)]


def test_appended_audio_goes_to_the_input_lane_once() -> None:
    h = handler()
    append = ev.InputAudioBufferAppend(audio=base64.b64encode(CHUNK).decode(), input_seq=1)
    assert h.on_client_event(append, CFG, 0) == [ProcessAudio(CHUNK)]
    assert h.on_client_event(append, CFG, 1) == []  # the same input again
    assert h.seqs.received == 1


def test_a_manual_commit_sends_the_buffer_and_announces_the_item() -> None:
    h = handler()
    with pytest.raises(ProtocolError) as info:
        h.on_client_event(ev.InputAudioBufferCommit(), MANUAL, 0)
    assert info.value.code == "input_audio_buffer_commit_empty"
    out = h.on_audio(CHUNK * 5, [], MANUAL, 0)
    assert [type(x) for x in calls(out)] == [Append]
    assert h.input_ms == 100.0
    out = h.on_client_event(ev.InputAudioBufferCommit(event_id="c"), MANUAL, 1)
    commit = calls(out)[-1]
    assert isinstance(commit, Commit) and not commit.respond and commit.event_id == "c"
    assert isinstance(sent(out)[0], ev.InputCommitted)


def test_a_clear_with_uncommitted_input_cancels_it_in_the_engine() -> None:
    h = handler()
    assert sent(h.on_client_event(ev.InputAudioBufferClear(), MANUAL, 0)) == [ev.InputCleared()]
    h.on_audio(CHUNK, [], MANUAL, 0)
    out = h.on_client_event(ev.InputAudioBufferClear(event_id="x"), MANUAL, 1)
    assert Cancel(0, "input.cancel", event_id="x") in calls(out)
    assert h.position.epoch == 1 and not h.turns.buffered


def test_speech_commits_a_turn_that_asks_for_a_response_and_barges_in() -> None:
    h = handler()
    h.responses.requested()  # an answer was requested and started before
    h.responses.on_engine_event(ResponseStarted(fence=Fence(SID, 0, 1, 1)), CFG, 0)
    out = h.on_audio(CHUNK, [VadStart(onset_ms=0.0, audio_start_ms=0.0)], CFG, 1000)
    item = sent(out)[0]
    assert isinstance(item, ev.SpeechStarted)
    out = h.on_audio(CHUNK * 15, [VadStop(audio_end_ms=300.0)], CFG, 1400)
    cmds = calls(out)
    assert Cancel(0, "barge_in") in cmds  # 300 ms of speech over the answer
    commit = cmds[-1]
    assert isinstance(commit, Commit) and commit.respond and commit.epoch == 1
    assert commit.item_id == item.item_id and h.responses.active
    assert h.timeline.moments["speech_stopped"] == 1400


def test_items_are_created_retrieved_and_deleted() -> None:
    h = handler()
    create = ev.ConversationItemCreate(
        item=ev.ItemParam(content=[ev.ContentPartParam(type="input_text", text="hi")])
    )
    out = h.on_client_event(create, CFG, 0)
    (append,) = calls(out)
    assert isinstance(append, Append) and append.text == "hi" and append.item_id is not None
    out = h.on_client_event(ev.ConversationItemRetrieve(item_id=append.item_id), CFG, 1)
    assert isinstance(sent(out)[0], ev.ItemRetrieved)
    out = h.on_client_event(ev.ConversationItemDelete(item_id=append.item_id), CFG, 2)
    assert isinstance(calls(out)[0], DeleteItem)
    assert sent(out) == [ev.ItemDeleted(item_id=append.item_id)]
    with pytest.raises(ProtocolError):
        h.on_client_event(ev.ConversationItemDelete(item_id=append.item_id), CFG, 3)


def test_session_update_returns_the_new_config_and_what_it_changes() -> None:
    h = handler()
    param = ev.SessionParam(
        instructions="be brief",
        audio=ev.AudioParam(input=ev.AudioInputParam(turn_detection=None)),
    )
    new, out = h.update(ev.SessionUpdate(session=param), CFG)
    assert new.instructions == "be brief" and new.turn_detection is None
    assert isinstance(calls(out)[0], Update)
    assert any(isinstance(a, ConfigureInput) for a in out)
    assert isinstance(sent(out)[-1], ev.SessionUpdated)


def test_a_keypad_digit_as_text_is_a_turn() -> None:
    h = handler()
    cfg = EffectiveSession(dtmf_as_text=True)
    out = h.on_dtmf("5", 1_700_000_000, cfg, 0)
    assert isinstance(sent(out)[0], ev.DtmfEventReceived)
    assert calls(out)[-1] == Commit(0, respond=True) and h.responses.active


def test_live_partials_are_deltas_of_the_speech_item_and_finals_mark_the_turn() -> None:
    h = handler()
    h.turns.speech_item = "item_live"
    fence = Fence(SID, 0, 0, 0)
    out = h.on_transcript(UserTranscript(fence=fence, text="ever", final=False), 0)
    assert sent(out) == [ev.InputTranscriptDelta(item_id="item_live", delta="ever")]
    h.on_transcript(UserTranscript(fence=fence, text="ever tried", final=True), 7)
    assert h.timeline.moments["transcript_ready"] == 7


def test_the_idle_timeout_prompts_once_after_an_answer() -> None:
    h = handler()
    cfg = EffectiveSession(turn_detection=ev.TurnDetection(idle_timeout_ms=5000))
    h.timeline.answer_ended(1000.0)
    assert h.on_audio(CHUNK, [], cfg, 5000) == []
    out = h.on_audio(CHUNK, [], cfg, 6000)
    timeout = sent(out)[0]
    assert isinstance(timeout, ev.InputTimeoutTriggered)
    commit = calls(out)[0]
    assert isinstance(commit, Commit) and commit.respond and commit.response is not None
    assert h.on_audio(CHUNK, [], cfg, 20_000) == []  # once per silence (and one is pending)
