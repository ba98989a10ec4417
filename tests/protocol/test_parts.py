"""The three parts of the session core, each driven alone: conversation items, the response
lifecycle, and input turns (VAD ring, speech items, barge-in guards)."""

from __future__ import annotations

import pytest

from duplex_contract.fence import Fence
from duplex_server.protocol import events as ev
from duplex_server.protocol.commands import Action, Send
from duplex_server.protocol.errors import ProtocolError
from duplex_server.protocol.input import (
    AudioReady,
    InputTurns,
    Paused,
    Resumed,
    Speaking,
    SpeechBegan,
    SpeechEnded,
    should_interrupt,
)
from duplex_server.protocol.items import Conversation, user_text
from duplex_server.protocol.responses import Response, Responses
from duplex_server.protocol.vad_events import VadPause, VadResume, VadStart, VadStop

SID = "sess_0123456789abcdef0123456789abcdef"
MS20 = b"\x01\x00" * 320  # 20 ms at the engine input rate


def events(actions: list[Action]) -> list[ev.ServerEvent]:
    return [a.event for a in actions if isinstance(a, Send)]


# ---------------------------------------------------------------------------- items
def test_item_ids_are_unique_and_chained() -> None:
    conv = Conversation(SID)
    a, b = conv.new_id("item"), conv.new_id("item")
    assert a != b and a.startswith("item_0123456789ab")
    first = events(conv.user_text(None, "hi"))
    assert isinstance(first[0], ev.ItemAdded) and first[0].previous_item_id is None
    second = events(conv.user_audio("item_x"))
    assert isinstance(second[0], ev.InputCommitted)
    assert second[0].previous_item_id == first[0].item.id
    assert conv.last_item == "item_x"
    assert conv.get("item_x") is not None and conv.get("nope") is None


def test_transcript_finds_its_item_even_before_the_commit_reply() -> None:
    conv = Conversation(SID)
    conv.user_audio("item_a")
    conv.user_audio("item_b")
    # turn 7's transcript arrives before any commit reply: the oldest pending item
    delta = events(conv.transcript(7, "he", final=False))
    assert isinstance(delta[0], ev.InputTranscriptDelta) and delta[0].item_id == "item_a"
    conv.commit_accepted("item_b", 8)
    done = events(conv.transcript(8, "hello", final=True))
    assert [type(e) for e in done] == [
        ev.InputTranscriptDelta,
        ev.InputTranscriptCompleted,
        ev.ItemDone,
    ]
    assert all(getattr(e, "item_id", "item_b") == "item_b" for e in done)
    item = conv.get("item_b")
    assert item is not None and item.content[0].transcript == "hello"
    assert conv.transcript(99, "stray", final=True) == []


def test_failed_commit_is_not_pending_and_items_are_bounded() -> None:
    conv = Conversation(SID)
    conv.user_audio("item_a")
    conv.commit_failed("item_a")
    assert conv.transcript(1, "x", final=False) == []
    for i in range(300):
        conv.user_text(f"t{i}", "x")
    assert conv.get("t0") is None and conv.get("t299") is not None
    conv.assistant_audio("item_r", 3, 2, 120.0)
    assert conv.assistant_record("item_r") == (3, 2, 120.0)


# ---------------------------------------------------------------------------- responses
def _resp(started_ms: float = 0.0) -> Response:
    return Response("resp_1", "item_1", Fence(SID, 0, 1, 1), started_ms, audio=True)


def test_response_lifecycle() -> None:
    r = Responses()
    assert not r.active and r.started_ms is None
    r.requested()
    assert r.active and r.current is None
    resp = _resp(50.0)
    assert r.next_request().options is None
    r.started(resp)
    assert r.pending == 0 and r.current is resp and r.started_ms == 50.0
    assert r.matching(Fence(SID, 0, 1, 1)) is resp and r.matching(Fence(SID, 0, 1, 2)) is None
    r.ended()
    assert not r.active


def test_cancel_drops_requested_responses() -> None:
    r = Responses()
    r.requested()
    r.requested()
    r.request_failed()
    assert r.pending == 1
    r.started(_resp())
    r.requested()
    cancelled = r.cancelled()
    assert cancelled is not None and r.pending == 0


# ---------------------------------------------------------------------------- input turns
def _turns() -> tuple[InputTurns, list[str]]:
    ids: list[str] = []

    def new_id() -> str:
        ids.append(f"item_{len(ids)}")
        return ids[-1]

    return InputTurns(new_id), ids


def test_without_turn_detection_audio_goes_straight_to_the_engine() -> None:
    turns, _ = _turns()
    assert turns.on_audio(MS20, [], None) == [AudioReady(MS20, 0.0)]
    assert turns.on_audio(MS20, [], None) == [AudioReady(MS20, 20.0)]  # on the input clock
    assert turns.input_ms == 40.0 and turns.uncommitted_ms == 40.0 and turns.buffered
    turns.committed()
    assert not turns.buffered


def test_idle_audio_waits_in_a_bounded_ring() -> None:
    turns, _ = _turns()
    td = ev.TurnDetection(prefix_padding_ms=300)
    for _ in range(200):  # 4 s of silence
        assert turns.on_audio(MS20, [], td) == []
    flushed = turns.flush()
    assert len(flushed) == 1 and isinstance(flushed[0], AudioReady)
    assert len(flushed[0].pcm) == 1300 * 32  # prefix padding + 1 s kept, no more


def test_a_speech_turn_in_steps() -> None:
    turns, ids = _turns()
    td = ev.TurnDetection(prefix_padding_ms=300)
    for _ in range(50):
        turns.on_audio(MS20, [], td)
    steps = turns.on_audio(MS20, [VadStart(onset_ms=1000.0, audio_start_ms=900.0)], td)
    assert steps[0] == SpeechBegan("item_0", 900.0)
    assert isinstance(steps[1], AudioReady) and len(steps[1].pcm) == (1020 - 900) * 32
    assert steps[1].stream_ms == 900.0  # where it starts on the input clock (the engine
    # times the silence between two turns with it, not with the wall clock)
    assert steps[2] == Speaking(20.0)
    steps = turns.on_audio(MS20, [VadPause(at_ms=1030.0)], td)
    assert [type(s) for s in steps] == [AudioReady, Paused, AudioReady, Speaking]
    # the audio up to the pause point, then the rest of the append
    assert steps[0] == AudioReady(MS20[: 10 * 32], 1020.0)
    assert steps[2] == AudioReady(MS20[10 * 32 :], 1030.0)
    steps = turns.on_audio(MS20, [VadResume(at_ms=1050.0)], td)
    assert [type(s) for s in steps] == [Resumed, AudioReady, Speaking]
    steps = turns.on_audio(MS20, [VadStop(audio_end_ms=1070.0)], td)
    assert [type(s) for s in steps] == [AudioReady, SpeechEnded]
    assert steps[1] == SpeechEnded("item_0", 1070.0, 70.0)
    assert turns.speech_item is None and ids == ["item_0"]


def test_a_pause_and_a_turn_end_cut_the_audio_at_their_point_for_any_append_size() -> None:
    """At a VAD pause the engine has the speech up to the pause point, and no more, before
    ``Paused``; a turn ends where the VAD decided it (``VadStop.at_ms``), the rest of the
    append waiting in the ring. So the pause's guess and the committed turn are the same
    audio for appends of 10 to 200 ms (they used to take the whole append the decision
    fell in, up to 200 ms more, and the next turn started elsewhere: Whisper's words
    changed with the append size)."""
    audio = bytes(range(256)) * 250  # 2 s at 16 kHz, every sample distinct enough
    guessed: set[bytes] = set()
    committed: set[bytes] = set()
    for chunk_ms in (10, 20, 40, 100, 200):
        turns, _ = _turns()
        td = ev.TurnDetection(prefix_padding_ms=0)
        step = chunk_ms * 32
        sent = b""
        for i in range(0, len(audio), step):
            end_ms = (i + step) / 32
            vad = []
            if i == 0:
                vad.append(VadStart(onset_ms=0.0, audio_start_ms=0.0))
            if i / 32 < 1234.0 <= end_ms:  # the pause was decided at 1234 ms
                vad.append(VadPause(at_ms=1234.0))
            if i / 32 < 1734.0 <= end_ms:  # the turn's end, at 1734 ms
                vad.append(VadStop(audio_end_ms=1234.0, at_ms=1734.0))
            for s in turns.on_audio(audio[i : i + step], vad, td):
                if isinstance(s, AudioReady):
                    assert s.stream_ms == len(sent) / 32  # in order, on the input clock
                    sent += s.pcm
                elif isinstance(s, Paused):
                    guessed.add(sent)
                elif isinstance(s, SpeechEnded):
                    committed.add(sent)
        assert audio.startswith(sent)  # nothing repeated; the rest waits in the ring
    assert guessed == {audio[: 1234 * 32]}
    assert committed == {audio[: 1734 * 32]}


def test_reset_and_manual_commit_end_the_speech() -> None:
    turns, _ = _turns()
    td = ev.TurnDetection()
    turns.on_audio(MS20, [VadStart(onset_ms=0.0, audio_start_ms=0.0)], td)
    assert turns.take_speech_item() == "item_0" and turns.speech_item is None
    turns.on_audio(MS20, [VadStart(onset_ms=20.0, audio_start_ms=20.0)], td)
    turns.reset()
    assert turns.speech_item is None and turns.flush() == []


def test_barge_in_guards() -> None:
    td = ev.TurnDetection(min_interrupt_speech_ms=200, uninterruptible_ms=500)

    def interrupts(speech: float, active: bool = True, started: float | None = 0.0) -> bool:
        return should_interrupt(
            td, speech, response_active=active, response_started_ms=started, now_ms=1000.0
        )

    assert interrupts(250)
    assert not interrupts(150)  # too short
    assert not interrupts(250, active=False)  # nothing to interrupt
    assert not interrupts(250, started=800.0)  # inside the uninterruptible window
    assert interrupts(250, started=None)  # a pending response (not started) is interrupted
    off = ev.TurnDetection(interrupt_response=False)
    assert not should_interrupt(off, 999, response_active=True, response_started_ms=0.0, now_ms=1e6)
    assert not should_interrupt(
        None, 999, response_active=True, response_started_ms=0.0, now_ms=1e6
    )


def test_user_text_items() -> None:
    part = ev.ContentPartParam(type="input_text", text="a")
    blank = ev.ContentPartParam(type="input_text", text=" ")
    assert user_text(ev.ItemParam(content=[part, blank, part])) == "a a"
    for item, param in [
        (ev.ItemParam(role="assistant", content=[part]), "item.role"),
        (
            ev.ItemParam(content=[part, ev.ContentPartParam(type="input_audio")]),
            "item.content.1.type",
        ),
        (ev.ItemParam(content=[blank]), "item.content"),
    ]:
        with pytest.raises(ProtocolError) as info:
            user_text(item)
        assert info.value.param == param
