"""Barge-in through the session machine (protocol/barge_in.py): confirm mode's pause, stop
and resume, over a WebSocket (the client plays: events only) and where the server plays
the answer (a far end that reports playout: the core holds and re-emits the audio, byte for
byte); a backchannel never becomes a turn; immediate mode is as it always was."""

from __future__ import annotations

from duplex_contract.fence import Fence
from duplex_contract.session_events import AudioChunk, ResponseDone
from duplex_server.protocol import events as ev
from duplex_server.protocol.commands import (
    Action,
    Append,
    Cancel,
    Commit,
    Discard,
    SendAudio,
    Speculate,
    Touch,
    TranscribeSpeech,
)
from duplex_server.protocol.machine import SessionMachine
from duplex_server.protocol.playout import FarEnd, Flushed, Played, Queued
from duplex_server.protocol.vad_events import VadPause, VadResume, VadStart, VadStop
from tests.protocol.test_session import CHUNK, calls, core, sent, start_response

CONFIRM = ev.TurnDetection(interrupt_mode="confirm")
RATE = 24000
CHUNK_MS = 100.0


def _pcm(start: int, ms: float) -> bytes:
    """Audio whose every sample says where it is (its index in the item, mod 2**15)."""
    n = int(RATE * ms / 1000)
    return b"".join(((start + i) % 32768).to_bytes(2, "little") for i in range(n))


def _audio(out: list[Action]) -> list[SendAudio]:
    return [a for a in out if isinstance(a, SendAudio)]


class Answer:
    """A response whose audio the engine produces 100 ms at a time."""

    def __init__(self, c: SessionMachine, now: float = 0.0) -> None:
        self.c = c
        self.fence: Fence = start_response(c, now=now)
        resp = c.responses.current
        assert resp is not None
        self.id, self.item = resp.id, resp.item_id
        self.ms = 0.0

    def chunk(self, now: float) -> list[Action]:
        start = int(RATE * self.ms / 1000)
        pcm = _pcm(start, CHUNK_MS)
        chunk = AudioChunk(self.fence, pcm, RATE, self.ms, CHUNK_MS, "word ")
        self.ms += CHUNK_MS
        return self.c.on_engine_event(chunk, now)

    def all_pcm(self) -> bytes:
        return _pcm(0, self.ms)

    def done(self, now: float) -> list[Action]:
        return self.c.on_engine_event(ResponseDone(fence=self.fence, status="completed"), now)


def _onset(c: SessionMachine, now: float) -> list[Action]:
    return c.on_input_audio(CHUNK, [VadStart(onset_ms=c.input.input_ms, audio_start_ms=0.0)], now)


def _voice(c: SessionMachine, ms: int, now: float) -> list[Action]:
    out: list[Action] = []
    for _ in range(ms // 20):
        out += c.on_input_audio(CHUNK, [], now)
    return out


def _quiet(c: SessionMachine, now: float) -> list[Action]:
    return c.on_input_audio(CHUNK, [VadPause(at_ms=c.input.input_ms)], now)


def _end(c: SessionMachine, now: float) -> list[Action]:
    """The speech ended where the last 20 ms began (its silence window: the test's time)."""
    return c.on_input_audio(CHUNK, [VadStop(audio_end_ms=c.input.input_ms - 20)], now)


def _words(c: SessionMachine, text: str, now: float) -> list[Action]:
    """The transcript of the speech being judged comes back."""
    return c.barge.words(c.config.turn_detection, c.barge.number, text, now)


def _kinds(out: list[Action]) -> list[type]:
    return [type(e) for e in sent(out)]


# ---------------------------------------------------------------------------- WebSocket
def test_a_backchannel_pauses_then_resumes_and_never_becomes_a_turn() -> None:
    c = core(turn_detection=CONFIRM)
    a = Answer(c)
    a.chunk(10)
    out = _onset(c, 1000)
    assert ev.OutputAudioPaused(response_id=a.id, item_id=a.item) in sent(out)
    out = _voice(c, 300, 1300) + a.chunk(1300)  # the engine goes on meanwhile
    assert _audio(out)  # over a WebSocket the client holds what it is sent
    assert not [x for x in calls(out) if isinstance(x, Cancel)]
    out = _quiet(c, 1400)
    assert not [x for x in calls(out) if isinstance(x, Speculate)]  # no guess of "yeah"
    (ask,) = [x for x in out if isinstance(x, TranscribeSpeech)]  # its words are asked for
    assert ask.speech == c.barge.number and len(ask.pcm) >= 2 * 16 * 300  # onset on
    assert ev.OutputAudioResumed not in _kinds(out)  # ... and waited for
    out = _words(c, "Yeah.", 1600)
    (resumed,) = [e for e in sent(out) if isinstance(e, ev.OutputAudioResumed)]
    assert resumed == ev.OutputAudioResumed(response_id=a.id, item_id=a.item)
    out = _end(c, 1900)
    assert _kinds(out) == [ev.SpeechStopped]  # no commit, no item
    assert calls(out)[-1] == Discard(0)  # the engine drops its audio; the epoch stays
    assert not [x for x in calls(out) if isinstance(x, Commit)]
    assert c.epoch == 0 and c.responses.current is not None
    assert c.barge.counts == {"pause": 1, "stop": 0, "resume": 1}


def test_words_stop_the_answer_as_the_immediate_rule_would_and_the_speech_is_a_turn() -> None:
    c = core(turn_detection=CONFIRM)
    a = Answer(c)
    a.chunk(10)
    _onset(c, 1000)
    out = _voice(c, 300, 1300) + _quiet(c, 1400)
    assert not [x for x in calls(out) if isinstance(x, Cancel)]  # judged by its words
    out = _words(c, "Wait, what?", 1600)
    assert Cancel(0, "barge_in") in calls(out)
    done = next(e for e in sent(out) if isinstance(e, ev.ResponseDone))
    assert done.response.status == "cancelled"
    assert ev.OutputAudioCleared(response_id=a.id) in sent(out)
    out = _end(c, 1900)
    assert [x for x in calls(out) if isinstance(x, Commit)]  # the next turn
    assert not [x for x in calls(out) if isinstance(x, Discard)]


def test_long_speech_stops_the_answer_at_the_confirm_window() -> None:
    c = core(turn_detection=ev.TurnDetection(interrupt_mode="confirm", confirm_window_ms=600))
    a = Answer(c)
    a.chunk(10)
    _onset(c, 1000)
    assert not [x for x in calls(_voice(c, 560, 1500)) if isinstance(x, Cancel)]
    assert Cancel(0, "barge_in") in calls(_voice(c, 40, 1600))


def test_late_words_after_a_resume_stop_it() -> None:
    c = core(turn_detection=CONFIRM)
    a = Answer(c)
    a.chunk(10)
    _onset(c, 1000)
    _voice(c, 300, 1300)
    assert ev.OutputAudioResumed not in _kinds(_quiet(c, 1400))
    assert ev.OutputAudioResumed not in _kinds(_voice(c, 20, 1990))
    assert ev.OutputAudioResumed in _kinds(_voice(c, 20, 2000))  # no words in 600 ms
    out = _words(c, "Stop.", 2100)
    assert Cancel(0, "barge_in") in calls(out)
    out = _end(c, 1900)
    assert [x for x in calls(out) if isinstance(x, Commit)]


def test_voice_that_comes_back_pauses_again_and_past_the_window_stops() -> None:
    c = core(turn_detection=CONFIRM)
    a = Answer(c)
    a.chunk(10)
    _onset(c, 1000)
    _voice(c, 300, 1300)
    _quiet(c, 1400)
    assert ev.OutputAudioResumed in _kinds(_words(c, "", 1500))  # no word: taken back
    _voice(c, 200, 1500)  # silence, still inside the speech's turn: nothing
    back = c.on_input_audio(CHUNK, [VadResume(at_ms=c.input.input_ms)], 1600)
    assert ev.OutputAudioPaused in _kinds(back)
    out = _voice(c, 300, 1900)  # 940 ms from the onset, ~640 ms of it voice
    assert Cancel(0, "barge_in") not in calls(out)  # (its pauses do not count)
    out = _voice(c, 200, 2100)  # 840 ms of voice: more than a backchannel
    assert Cancel(0, "barge_in") in calls(out)


def test_no_pause_before_the_answer_is_heard_the_immediate_rule_applies() -> None:
    c = core(turn_detection=CONFIRM)
    start_response(c)  # no audio yet: the user goes on, not over an answer
    out = _onset(c, 1000)
    assert ev.OutputAudioPaused not in _kinds(out)
    assert Cancel(0, "barge_in") in calls(_voice(c, 200, 1200))


def test_a_websocket_client_is_believed_to_play_an_answer_until_its_audio_has_played() -> None:
    c = core(turn_detection=CONFIRM)
    a = Answer(c, now=0)
    for _ in range(20):  # 2 s of audio, all emitted at once
        a.chunk(100)
    a.done(200)
    assert ev.OutputAudioPaused in _kinds(_onset(c, 1500))  # it still plays
    out = _voice(c, 300, 1800) + _quiet(c, 1900) + _words(c, "What?", 2000)
    assert sent(out)[-1] == ev.OutputAudioCleared(response_id=a.id)  # it ended: a clear
    assert c.epoch == 0
    c2 = core(turn_detection=CONFIRM)
    b = Answer(c2, now=0)
    b.chunk(100)
    b.done(200)
    assert ev.OutputAudioPaused not in _kinds(_onset(c2, 5000))  # long played out


def test_immediate_mode_and_auto_over_a_websocket_cancel_as_before() -> None:
    for td in (ev.TurnDetection(), ev.TurnDetection(interrupt_mode="immediate")):
        c = core(turn_detection=td)
        a = Answer(c)
        a.chunk(10)
        out = _onset(c, 1000)
        assert ev.OutputAudioPaused not in _kinds(out)
        assert Cancel(0, "barge_in") in calls(_voice(c, 120, 1200))
        assert [x for x in calls(_end(c, 1800)) if isinstance(x, Commit)]


# ---------------------------------------------------------------------------- server playout
def _media(td: ev.TurnDetection | None = None) -> SessionMachine:
    c = core(turn_detection=td or ev.TurnDetection())  # auto: confirm here
    assert c.on_playout(FarEnd(), 0) == []
    return c


def _played(c: SessionMachine, a: Answer, ms: float, now: float) -> None:
    c.on_playout(Queued(a.item), now)
    c.on_playout(Played(a.item, ms, a.ms - ms), now)


def test_a_paused_answer_resumes_from_its_last_played_sample_with_nothing_lost() -> None:
    c = _media()
    a = Answer(c)
    sent_before = b"".join(x.pcm for x in _audio(a.chunk(10) + a.chunk(20) + a.chunk(30)))
    _played(c, a, 123.4, 1000)
    out = _onset(c, 1000)
    assert ev.OutputAudioPaused in _kinds(out)
    held = a.chunk(1100) + a.chunk(1200)  # the engine goes on: held in the core
    assert _audio(held) == []
    assert c.on_playout(Flushed(), 1010) == []  # the pause's flush: no truncation
    _voice(c, 300, 1300)
    out = _quiet(c, 1400) + _words(c, "Mm-hmm.", 1500)
    (resumed,) = [e for e in sent(out) if isinstance(e, ev.OutputAudioResumed)]
    again = _audio(out)
    assert resumed.audio_start_ms == again[0].audio_start_ms
    start = 2 * round(123.4 * RATE / 1000)
    assert again[0].audio_start_ms == start / 2 / RATE * 1000 and again[0].restart
    assert not any(x.restart for x in again[1:])
    # what the far end heard and what it is sent now is the whole item, byte for byte
    heard = sent_before[:start]
    assert heard + b"".join(x.pcm for x in again) == a.all_pcm()
    assert all(x.epoch == 0 and x.item_id == a.item for x in again)
    assert max(x.duration_ms for x in again) <= 100.0
    assert _audio(a.chunk(1500)) != []  # and the answer streams on
    assert [x for x in calls(_end(c, 1900)) if isinstance(x, Discard)]


def test_a_stop_after_a_pause_truncates_to_what_was_heard_and_emits_nothing_held() -> None:
    c = _media()
    a = Answer(c)
    a.chunk(10)
    a.chunk(20)
    _played(c, a, 150.0, 1000)
    _onset(c, 1000)
    c.on_playout(Flushed(), 1010)
    a.chunk(1100)
    out = _voice(c, 300, 1300) + _quiet(c, 1400) + _words(c, "Hold on.", 1500)
    assert Cancel(0, "barge_in") in calls(out) and _audio(out) == []
    assert ev.OutputAudioCleared(response_id=a.id) in sent(out)
    out = c.on_playout(Flushed(), 1410)  # the stop's flush
    (cut,) = [e for e in sent(out) if isinstance(e, ev.ItemTruncated)]
    assert cut.item_id == a.item and cut.audio_end_ms == 150
    (touch,) = calls(out)
    assert isinstance(touch, Touch) and touch.playback is not None
    assert touch.playback.truncate and touch.playback.played_ms == 150.0


def test_a_resume_decided_before_the_pause_was_flushed_waits_for_the_flush() -> None:
    c = _media()
    a = Answer(c)
    a.chunk(10)
    a.chunk(20)
    _played(c, a, 60.0, 1000)
    _onset(c, 1000)
    _voice(c, 100, 1100)
    out = _quiet(c, 1150) + _words(c, "Yeah.", 1155)  # the far end has not flushed yet
    assert ev.OutputAudioResumed in _kinds(out) and _audio(out) == []
    c.on_playout(Played(a.item, 80.0, 120.0), 1160)  # it played on until the flush
    out = c.on_playout(Flushed(), 1170)
    again = _audio(out)
    assert again and again[0].audio_start_ms == 80.0
    assert _pcm(0, 80.0) + b"".join(x.pcm for x in again) == a.all_pcm()
    assert not [e for e in sent(out) if isinstance(e, ev.ItemTruncated)]


def test_talking_over_a_finished_answer_still_playing_pauses_then_clears_it_once() -> None:
    c = _media()
    a = Answer(c)
    for t in range(5):
        a.chunk(t)
    a.done(10)
    _played(c, a, 200.0, 1000)
    assert c.responses.current is None
    assert ev.OutputAudioPaused in _kinds(_onset(c, 1000))
    c.on_playout(Flushed(), 1010)
    out = _voice(c, 800, 1800)  # past the window
    assert sent(out)[-1] == ev.OutputAudioCleared(response_id=a.id)
    assert not [x for x in calls(out) if isinstance(x, Cancel)]  # nothing to cancel
    out = c.on_playout(Flushed(), 1810)
    (cut,) = [e for e in sent(out) if isinstance(e, ev.ItemTruncated)]
    assert cut.audio_end_ms == 200


def test_a_cancel_during_a_pause_drops_what_was_held() -> None:
    c = _media()
    a = Answer(c)
    a.chunk(10)
    _played(c, a, 50.0, 1000)
    _onset(c, 1000)
    c.on_playout(Flushed(), 1010)
    a.chunk(1100)
    out = c.on_client_event(ev.ResponseCancel(), 1200)
    assert Cancel(0, "response.cancel") in calls(out)
    out = _voice(c, 100, 1300) + _quiet(c, 1400)  # its answer is gone: nothing to resume
    assert _audio(out) == [] and ev.OutputAudioResumed not in _kinds(out)
    assert [x for x in calls(_end(c, 1900)) if isinstance(x, Commit)]


def test_a_media_session_pinned_to_immediate_cancels_as_before() -> None:
    c = _media(ev.TurnDetection(interrupt_mode="immediate"))
    a = Answer(c)
    a.chunk(10)
    _played(c, a, 50.0, 1000)
    assert ev.OutputAudioPaused not in _kinds(_onset(c, 1000))
    assert Cancel(0, "barge_in") in calls(_voice(c, 120, 1200))


def test_speech_too_short_is_taken_back_at_once_and_old_words_are_dropped() -> None:
    c = core(turn_detection=ev.TurnDetection(interrupt_mode="confirm", min_interrupt_speech_ms=200))
    a = Answer(c)
    a.chunk(10)
    _onset(c, 1000)
    _voice(c, 60, 1060)
    out = _quiet(c, 1100)  # 80 ms: no words needed
    assert ev.OutputAudioResumed in _kinds(out)
    assert not [x for x in out if isinstance(x, TranscribeSpeech)]
    _end(c, 1600)
    number = c.barge.number
    _onset(c, 2000)
    _voice(c, 300, 2300)
    _quiet(c, 2400)
    td = c.config.turn_detection
    assert c.barge.words(td, number, "Stop!", 2450) == []  # the words of the speech before
    assert Cancel(0, "barge_in") in calls(_words(c, "Stop!", 2500))


def test_a_speech_whose_words_come_after_its_end_is_settled_by_them() -> None:
    """A loaded ASR stage: the speech is taken back on its acoustics and ends before its
    words come; they decide whether it was an interruption (its turn kept) or not."""
    for words, interrupted in (("Try again.", True), ("Mm-hmm.", False)):
        c = core(turn_detection=CONFIRM)
        a = Answer(c)
        a.chunk(10)
        _onset(c, 1000)
        _voice(c, 300, 1300)
        _quiet(c, 1400)
        assert ev.OutputAudioResumed in _kinds(_voice(c, 20, 2000))  # no words in time
        out = _end(c, 2000)
        assert _kinds(out) == [ev.SpeechStopped]
        assert not [x for x in calls(out) if isinstance(x, Commit | Discard)]  # not yet
        out = c.input.speech_words(c.barge.number, words, c.config, 2600)
        if interrupted:
            assert Cancel(0, "barge_in") in calls(out)
            assert [x for x in calls(out) if isinstance(x, Commit)]  # its turn, kept
        else:
            assert calls(out) == [Discard(0)] and c.epoch == 0


def test_a_speech_whose_words_never_come_is_dropped_in_time_or_at_the_next_speech() -> None:
    c = core(turn_detection=CONFIRM)
    a = Answer(c)
    a.chunk(10)
    _onset(c, 1000)
    _voice(c, 300, 1300)
    _quiet(c, 1400)
    _voice(c, 20, 2000)
    _end(c, 2000)
    assert not [x for x in calls(_voice(c, 20, 4400)) if isinstance(x, Discard)]
    assert [x for x in calls(_voice(c, 20, 4500)) if isinstance(x, Discard)]  # SETTLE_MS
    assert c.input.speech_words(c.barge.number, "Stop!", c.config, 4600) == []  # too late
    c2 = core(turn_detection=CONFIRM)
    b = Answer(c2)
    b.chunk(10)
    _onset(c2, 1000)
    _voice(c2, 300, 1300)
    _quiet(c2, 1400)
    _voice(c2, 20, 2000)
    _end(c2, 2000)
    out = _onset(c2, 2500)  # the next speech: the one before stays dropped, first
    kinds = [type(x) for x in calls(out)]
    assert kinds[0] is Discard and Append in kinds
