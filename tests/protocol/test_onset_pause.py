"""Confirm mode pauses the answer on the VAD's first window of voice (``VadOnset``), one
window before the speech starts: the start keeps that pause (one ``paused``, one
verdict), and an onset lost first (``VadOnsetLost``: it fell silent, or hovered between
the VAD's thresholds) takes it back with nothing lost."""

from __future__ import annotations

from duplex_server.protocol import events as ev
from duplex_server.protocol.commands import Action, Cancel, Commit, Discard
from duplex_server.protocol.machine import SessionMachine
from duplex_server.protocol.playout import Flushed
from duplex_server.protocol.vad_events import VadOnset, VadOnsetLost
from tests.protocol.test_barge_in import (
    CONFIRM,
    Answer,
    _audio,
    _kinds,
    _media,
    _onset,
    _played,
    _quiet,
    _voice,
    _words,
)
from tests.protocol.test_session import CHUNK, calls, core, sent


def _heard(c: SessionMachine, now: float) -> list[Action]:
    return c.on_input_audio(CHUNK, [VadOnset(at_ms=c.input.input_ms)], now)


def _lost(c: SessionMachine, now: float) -> list[Action]:
    return c.on_input_audio(CHUNK, [VadOnsetLost(at_ms=c.input.input_ms)], now)


def _paused(played_ms: float) -> tuple[SessionMachine, Answer]:
    """A media session whose answer (two chunks, ``played_ms`` of it played) an onset
    paused at 1000 ms, flushed at the far end."""
    c = _media()
    a = Answer(c)
    a.chunk(10)
    a.chunk(20)
    _played(c, a, played_ms, 1000)
    out = _heard(c, 1000)
    assert sent(out) == [ev.OutputAudioPaused(response_id=a.id, item_id=a.item)]
    assert _audio(a.chunk(1010)) == []  # held from the onset on
    c.on_playout(Flushed(), 1015)
    return c, a


def test_an_onset_pauses_the_answer_and_the_speech_that_follows_keeps_that_pause() -> None:
    c, _ = _paused(150.0)
    out = _onset(c, 1032)  # the speech starts one window later: no second pause
    assert _kinds(out) == [ev.SpeechStarted]
    assert c.barge.counts == {"pause": 1, "stop": 0, "resume": 0}
    out = _voice(c, 300, 1300) + _quiet(c, 1400) + _words(c, "Hold on.", 1500)
    assert Cancel(0, "barge_in") in calls(out) and _audio(out) == []  # words stop it
    assert c.barge.counts == {"pause": 1, "stop": 1, "resume": 0}
    (cut,) = [e for e in sent(c.on_playout(Flushed(), 1510)) if isinstance(e, ev.ItemTruncated)]
    assert cut.audio_end_ms == 150  # truncated to what was heard before the onset's pause


def test_an_onset_that_falls_silent_resumes_the_answer_with_nothing_lost() -> None:
    c = _media()
    a = Answer(c)
    sent_before = b"".join(x.pcm for x in _audio(a.chunk(10) + a.chunk(20) + a.chunk(30)))
    _played(c, a, 123.4, 1000)
    assert ev.OutputAudioPaused in _kinds(_heard(c, 1000))
    c.on_playout(Flushed(), 1010)
    assert _audio(a.chunk(1020)) == []
    out = _lost(c, 1064)  # a click: silence came before the speech
    (resumed,) = [e for e in sent(out) if isinstance(e, ev.OutputAudioResumed)]
    again = _audio(out)
    assert again and resumed.audio_start_ms == again[0].audio_start_ms
    start = 2 * round(123.4 * 24000 / 1000)
    assert sent_before[:start] + b"".join(x.pcm for x in again) == a.all_pcm()
    # no speech, no turn: nothing committed or discarded, the epoch stays
    assert not [x for x in calls(out) if isinstance(x, (Commit, Discard, Cancel))]
    assert c.epoch == 0 and c.barge.counts == {"pause": 1, "stop": 0, "resume": 1}
    assert _audio(a.chunk(1100)) != []  # the answer streams on


def test_a_speech_that_starts_after_its_onset_was_taken_back_pauses_anew() -> None:
    c, _ = _paused(50.0)
    out = _lost(c, 1200)  # (told lost after ONSET_HOLD_MS of neither speech nor silence)
    assert ev.OutputAudioResumed in _kinds(out) and _audio(out)
    assert _lost(c, 1300) == []  # nothing left to take back
    assert ev.OutputAudioPaused in _kinds(_onset(c, 1400))  # the speech's own pause
    assert c.barge.counts == {"pause": 2, "stop": 0, "resume": 1}


def test_an_onset_does_nothing_in_immediate_mode_unheard_or_in_the_first_window() -> None:
    ws = core(turn_detection=ev.TurnDetection())  # auto on a WebSocket: immediate
    a = Answer(ws)
    a.chunk(10)
    assert sent(_heard(ws, 1000)) == [] and ws.barge.tentative is None
    quiet = _media()
    Answer(quiet)  # its audio not started yet
    assert sent(_heard(quiet, 1000)) == []
    early = _media(ev.TurnDetection(uninterruptible_ms=2000))
    b = Answer(early, now=0.0)
    b.chunk(10)
    _played(early, b, 100.0, 500)
    assert sent(_heard(early, 500)) == []


def test_an_opted_in_websocket_client_is_told_to_pause_at_the_onset() -> None:
    c = core(turn_detection=CONFIRM)
    a = Answer(c)
    a.chunk(10)
    assert sent(_heard(c, 100)) == [ev.OutputAudioPaused(response_id=a.id, item_id=a.item)]
    (resumed,) = [e for e in sent(_lost(c, 140)) if isinstance(e, ev.OutputAudioResumed)]
    assert resumed == ev.OutputAudioResumed(response_id=a.id, item_id=a.item)


def test_a_new_input_lane_takes_back_an_onsets_pause() -> None:
    """A ``session.update`` that reconfigures the input lane gives it a new VAD, which
    will never tell the onset lost: the pause on it is taken back at once (no answer is
    left paused), and an update that keeps the lane changes nothing."""
    c, _ = _paused(50.0)
    same = ev.SessionUpdate(session=ev.SessionParam(instructions="Be brief."))
    assert ev.OutputAudioResumed not in _kinds(c.on_client_event(same, 1020))
    td = ev.TurnDetectionParam(silence_duration_ms=700)
    out = c.on_client_event(ev.SessionUpdate(session=ev.SessionParam(turn_detection=td)), 1030)
    assert ev.OutputAudioResumed in _kinds(out) and _audio(out)
    assert c.barge.counts == {"pause": 1, "stop": 0, "resume": 1}
    assert _lost(c, 1100) == []
