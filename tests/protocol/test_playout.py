"""Talking over audio the far end still plays after its response ended (protocol/playout.py),
through the session core: the same guards as a barge-in on a response in progress."""

from __future__ import annotations

import gc

from duplex_contract.events import ResponseDone
from duplex_server.protocol import events as ev
from duplex_server.protocol.commands import Action, Cancel
from duplex_server.protocol.session import SessionCore
from tests.protocol.test_session import CHUNK, _speak, calls, core, sent, start_response


class Phone:
    """A far end (the FarEnd interface): plays ``playing`` until told otherwise."""

    def __init__(self, playing: str | None) -> None:
        self.now_playing = playing

    def playing(self) -> str | None:
        return self.now_playing


def _answered(c: SessionCore, started: float, ended: float) -> str:
    """A response that started at ``started`` and is over at ``ended``; its id."""
    fence = start_response(c, now=started)
    resp = c.responses.current
    assert resp is not None
    c.on_engine_event(ResponseDone(fence=fence, status="completed"), ended)
    assert not c.response_active
    return resp.id


def _cleared(out: list[Action]) -> list[ev.OutputAudioCleared]:
    return [e for e in sent(out) if isinstance(e, ev.OutputAudioCleared)]


def test_talking_over_far_end_audio_clears_it_once_after_min_interrupt_speech() -> None:
    c = core(turn_detection=ev.TurnDetection(min_interrupt_speech_ms=300))
    rid = _answered(c, started=0, ended=100)
    phone = Phone(rid)
    c.talk_over.attach(phone)
    out = _speak(c, 200, now=2000)  # 220 ms of speech: shorter than min_interrupt_speech_ms
    for _ in range(3):  # 240, 260, 280 ms
        out += c.on_input_audio(CHUNK, [], 2100)
    assert _cleared(out) == []
    out = c.on_input_audio(CHUNK, [], 2120)  # 300 ms
    assert _cleared(out) == [ev.OutputAudioCleared(response_id=rid)]
    assert not any(isinstance(x, Cancel) for x in calls(out))  # nothing to cancel: it ended
    assert c.epoch == 0
    # the transport flushes later: until then more speech clears nothing twice
    assert _cleared(c.on_input_audio(CHUNK, [], 2140)) == []


def test_the_uninterruptible_window_counts_from_the_playing_responses_start() -> None:
    c = core(turn_detection=ev.TurnDetection(min_interrupt_speech_ms=0, uninterruptible_ms=1000))
    rid = _answered(c, started=0, ended=100)
    c.talk_over.attach(phone := Phone(rid))
    assert _cleared(_speak(c, 100, now=500)) == []  # inside the window
    assert _cleared(c.on_input_audio(CHUNK, [], 1000)) == [ev.OutputAudioCleared(response_id=rid)]
    assert phone.playing() == rid


def test_interrupt_response_off_or_nothing_playing_never_clears() -> None:
    c = core(turn_detection=ev.TurnDetection(interrupt_response=False))
    c.talk_over.attach(Phone(_answered(c, started=0, ended=100)))
    assert _cleared(_speak(c, 600, now=5000)) == []
    c2 = core()
    _answered(c2, started=0, ended=100)
    c2.talk_over.attach(Phone(None))  # all of it was played
    assert _cleared(_speak(c2, 600, now=5000)) == []
    c3 = core()
    _answered(c3, started=0, ended=100)  # no far end attached: a WebSocket client
    assert _cleared(_speak(c3, 600, now=5000)) == []


def test_a_response_in_progress_is_cancelled_by_the_usual_rule_not_talk_over() -> None:
    c = core()
    start_response(c, now=0)
    resp = c.responses.current
    assert resp is not None
    c.talk_over.attach(Phone(resp.id))
    out = _speak(c, 200, now=500)
    assert Cancel(0, "barge_in") in calls(out)
    assert _cleared(out) == [ev.OutputAudioCleared(response_id=resp.id)]  # once, by the cancel


def test_the_core_holds_its_far_end_weakly() -> None:
    c = core()
    rid = _answered(c, started=0, ended=100)
    c.talk_over.attach(Phone(rid))
    gc.collect()  # the transport is gone: nothing plays, nothing is kept alive
    assert _cleared(_speak(c, 600, now=5000)) == []
