"""Input exactly once, pure: the numbering of input messages, and the core dropping a
re-sent append or item while numbering appends for the engine (no sockets, no clock)."""

from __future__ import annotations

import base64

from duplex_server.protocol import events as ev
from duplex_server.protocol.commands import Append, Call, ProcessAudio, Send
from duplex_server.protocol.input_seq import InputSequence
from duplex_server.protocol.machine import SessionMachine
from duplex_server.protocol.session_config import EffectiveSession

SID = "sess_0123456789abcdef0123456789abcdef"
FRAME_24K = b"\x01\x00" * 480  # 20 ms at 24 kHz (the session's input format)
CHUNK_16K = b"\x01\x00" * 320  # 20 ms at 16 kHz (what the input lane hands the core)


def _core() -> SessionMachine:
    c = SessionMachine(SID, EffectiveSession(turn_detection=None))
    caps = ev.Capabilities(True, True, ["pcm16"], ["pcm16"], ["server_vad"], "energy", 1, 1, 1.0)
    c.opened("tok", caps)
    return c


def _append(seq: int | None) -> ev.InputAudioBufferAppend:
    return ev.InputAudioBufferAppend(audio=base64.b64encode(FRAME_24K).decode(), input_seq=seq)


def test_explicit_numbers_drop_resends_and_implicit_ones_count_on() -> None:
    s = InputSequence()
    assert [s.accept(1), s.accept(2), s.accept(None)] == [1, 2, 3]
    assert s.accept(2) is None and s.accept(3) is None  # re-sent: dropped
    assert s.dropped == 2
    assert s.accept(7) == 7  # a gap is allowed (input the client never sent here)
    assert s.accept(None) == 8


def test_an_append_carries_the_newest_message_its_audio_completes() -> None:
    s = InputSequence()
    for seq in (1, 2, 3):
        s.accept(seq)
        s.audio(seq, 20.0)
    assert s.processed(30.0) == 1  # message 2 is only half through the lane
    assert s.processed(60.0) == 3
    assert s.processed(80.0) is None  # nothing new: the engine would drop an equal seq
    assert s.text(3) is None and s.text(4) == 4  # numbers given to the engine only grow


def test_adopt_starts_from_what_the_engine_has() -> None:
    s = InputSequence()
    s.accept(1)
    s.audio(1, 20.0)
    s.adopt(40)
    assert s.accept(40) is None and s.accept(41) == 41
    assert s.processed(1000.0) is None  # the old marks are gone


def test_core_drops_a_resent_append_and_numbers_the_engine_append() -> None:
    c = _core()
    first = c.on_client_event(_append(1), 0.0)
    assert [type(a) for a in first] == [ProcessAudio]
    assert c.on_client_event(_append(1), 1.0) == []  # the same input again: nothing
    out = c.on_input_audio(CHUNK_16K, [], 2.0)
    appends = [a.command for a in out if isinstance(a, Call) and isinstance(a.command, Append)]
    assert [a.seq for a in appends] == [1]
    assert c.seqs.received == 1


def test_binary_frames_are_numbered_implicitly_and_resume_reports_the_count() -> None:
    c = _core()
    for _ in range(3):
        c.frame_received(len(FRAME_24K))
    assert c.seqs.received == 3
    c.resumed(2, "tok2", b"", after_seq=0, attached=False)
    resumed = [a.event for a in c.replayed([], 0, 0) if isinstance(a, Send)]
    assert isinstance(resumed[-1], ev.SessionResumed)
    assert resumed[-1].last_input_seq == 3


def test_a_resent_item_create_is_dropped() -> None:
    c = _core()
    part = ev.ContentPartParam(type="input_text", text="hi")
    item = ev.ConversationItemCreate(item=ev.ItemParam(content=[part]), input_seq=5)
    first = c.on_client_event(item, 0.0)
    appends = [a.command for a in first if isinstance(a, Call)]
    assert len(appends) == 1 and isinstance(appends[0], Append) and appends[0].seq == 5
    assert c.on_client_event(item, 1.0) == []
