"""Playout state (protocol/playout.py): what the core emitted and what a media transport's
far end reported of it, alone and through the session machine. Talking over audio the far
end still plays after its response ended clears it by the same guards as a barge-in on a
response in progress; a flush truncates the item to what was heard, as the core's own
decision."""

from __future__ import annotations

from duplex_contract.session_events import AudioChunk, ResponseDone
from duplex_server.protocol import events as ev
from duplex_server.protocol.commands import Action, Cancel, Touch
from duplex_server.protocol.machine import SessionMachine
from duplex_server.protocol.playout import (
    Flushed,
    Played,
    Playout,
    PlayoutPosition,
    Queued,
)
from tests.protocol.test_session import CHUNK, _speak, calls, core, sent, start_response

TD = ev.TurnDetection()


# ---------------------------------------------------------------------------- Playout alone
def test_nothing_plays_until_the_far_end_is_handed_audio() -> None:
    p = Playout()
    p.emitted("resp_a", "item_a", 500.0, 24000)
    assert p.playing() is None  # a WebSocket client never reports: never "playing"
    p.report(Queued("item_a"))
    assert p.playing() == "resp_a"
    p.report(Played("item_a", 300.0, 200.0))
    assert p.playing() == "resp_a"
    # the far end rendered less than was emitted (a resampler's tail) but holds nothing
    p.report(Played("item_a", 480.0, 0.0))
    assert p.playing() is None


def test_the_item_handed_last_is_the_one_playing() -> None:
    p = Playout()
    p.emitted("resp_a", "item_a", 500.0, 24000)
    p.report(Queued("item_a"))
    p.emitted("resp_b", "item_b", 200.0, 24000)
    p.report(Queued("item_b"))
    p.report(Played("item_a", 500.0, 0.0))  # a late report of the item before: still b
    assert p.playing() == "resp_b"


def test_a_flush_cuts_the_item_to_what_was_heard_only_if_audio_was_dropped() -> None:
    p = Playout()
    p.emitted("resp_a", "item_a", 2000.0, 24000)
    p.report(Queued("item_a"))
    p.report(Played("item_a", 700.0, 1300.0))
    assert p.flushed() == PlayoutPosition("item_a", "resp_a", 700.0, 2000.0, 24000)
    assert p.playing() is None and p.flushed() is None  # the far end holds nothing now
    p.report(Played("item_a", 900.0, 0.0))  # a late mark of the flushed audio: ignored
    assert p.position("item_a") is None
    q = Playout()
    q.emitted("resp_b", "item_b", 400.0, 24000)
    q.report(Queued("item_b"))
    q.report(Played("item_b", 390.0, 0.0))  # all of it was heard
    assert q.flushed() is None


def test_a_flush_keeps_the_items_emitted_after_the_one_playing() -> None:
    p = Playout()
    p.emitted("resp_a", "item_a", 900.0, 24000)
    p.report(Queued("item_a"))
    p.emitted("resp_b", "item_b", 100.0, 24000)  # queued behind the clear: not flushed
    cut = p.flushed()
    assert cut is not None and cut.item_id == "item_a"
    assert p.position("item_b") is not None and p.position("item_a") is None
    p.report(Queued("item_b"))
    assert p.playing() == "resp_b"


def test_the_position_says_where_a_pause_would_resume() -> None:
    p = Playout()
    assert p.position() is None
    p.emitted("resp_a", "item_a", 1000.0, 24000)
    p.report(Queued("item_a"))
    p.report(Played("item_a", 250.5, 749.5))
    pos = p.position()
    assert pos == PlayoutPosition("item_a", "resp_a", 250.5, 1000.0, 24000)
    assert pos.played_bytes == 2 * 6012  # whole samples of the item's PCM16 at 24 kHz


def test_only_a_few_items_are_kept_but_never_the_one_playing() -> None:
    p = Playout()
    p.emitted("resp_0", "item_0", 100.0, 24000)
    p.report(Queued("item_0"))
    for i in range(1, 10):
        p.emitted(f"resp_{i}", f"item_{i}", 100.0, 24000)
    assert p.playing() == "resp_0"
    assert p.position("item_1") is None and p.position("item_9") is not None


def test_talk_over_is_decided_once_per_response_by_the_barge_in_guards() -> None:
    p = Playout()
    p.emitted("resp_a", "item_a", 3000.0, 24000)
    p.report(Queued("item_a"))
    late = ev.TurnDetection(min_interrupt_speech_ms=0, uninterruptible_ms=1000)
    assert p.talk_over(late, 10, last_started=("resp_a", 0.0), now_ms=500) == []
    assert p.talk_over(late, 10, last_started=("resp_x", 0.0), now_ms=500) != []
    assert p.talk_over(late, 10, last_started=("resp_a", 0.0), now_ms=5000) == []  # once


# ---------------------------------------------------------------------------- the machine
def _answered(c: SessionMachine, started: float, ended: float, audio_ms: float = 3000.0) -> str:
    """A response with ``audio_ms`` of audio that started at ``started`` and is over at
    ``ended``; the far end was handed its audio. Its id."""
    fence = start_response(c, now=started)
    resp = c.responses.current
    assert resp is not None
    pcm = b"\0" * int(48 * audio_ms)
    chunk = AudioChunk(fence, pcm, 24000, audio_start_ms=0.0, duration_ms=audio_ms)
    c.on_engine_event(chunk, started)
    c.on_engine_event(ResponseDone(fence=fence, status="completed"), ended)
    assert not c.responses.active
    assert c.on_playout(Queued(resp.item_id), ended) == []
    return resp.id


def _cleared(out: list[Action]) -> list[ev.OutputAudioCleared]:
    return [e for e in sent(out) if isinstance(e, ev.OutputAudioCleared)]


def test_talking_over_far_end_audio_clears_it_once_after_min_interrupt_speech() -> None:
    c = core(turn_detection=ev.TurnDetection(min_interrupt_speech_ms=300))
    rid = _answered(c, started=0, ended=100)
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
    assert _cleared(_speak(c, 100, now=500)) == []  # inside the window
    assert _cleared(c.on_input_audio(CHUNK, [], 1000)) == [ev.OutputAudioCleared(response_id=rid)]
    assert c.playout.playing() == rid  # until the far end reports its flush


def test_interrupt_response_off_or_nothing_playing_never_clears() -> None:
    c = core(turn_detection=ev.TurnDetection(interrupt_response=False))
    _answered(c, started=0, ended=100)
    assert _cleared(_speak(c, 600, now=5000)) == []
    c2 = core()
    rid = _answered(c2, started=0, ended=100)
    item = c2.playout.position()
    assert item is not None and item.response_id == rid
    c2.on_playout(Played(item.item_id, 2990.0, 0.0), 3000)  # all of it was played
    assert _cleared(_speak(c2, 600, now=5000)) == []


def test_a_session_whose_transport_reports_nothing_never_clears() -> None:
    """A WebSocket client plays (and clears) its own audio: the core holds no transport and
    is told nothing, so no playout is ever pending."""
    c = core()
    fence = start_response(c, now=0)
    pcm = b"\0" * 48_000
    c.on_engine_event(AudioChunk(fence, pcm, 24000, audio_start_ms=0.0, duration_ms=1e3), 0)
    c.on_engine_event(ResponseDone(fence=fence, status="completed"), 100)
    assert c.playout.playing() is None
    assert _cleared(_speak(c, 600, now=5000)) == []


def test_a_response_in_progress_is_cancelled_by_the_usual_rule_not_talk_over() -> None:
    c = core()
    start_response(c, now=0)
    resp = c.responses.current
    assert resp is not None
    out = _speak(c, 200, now=500)
    assert Cancel(0, "barge_in") in calls(out)
    assert _cleared(out) == [ev.OutputAudioCleared(response_id=resp.id)]  # once, by the cancel


def test_a_flush_truncates_the_item_to_what_the_far_end_played() -> None:
    c = core()
    _answered(c, started=0, ended=100)
    item = c.items.last_item
    assert item is not None
    c.on_playout(Played(item, 1234.7, 1700.0), 1300)
    out = c.on_playout(Flushed(), 1400)
    (truncated,) = sent(out)
    assert truncated == ev.ItemTruncated(
        item_id=item, content_index=0, audio_end_ms=1234, requested_audio_end_ms=1234
    )
    (touch,) = calls(out)
    assert isinstance(touch, Touch) and touch.playback is not None
    assert touch.playback.truncate and touch.playback.played_ms == 1234.0
    assert touch.event_id is None  # the core's own decision, not a client's event
    assert c.on_playout(Flushed(), 1500) == []  # nothing held any more
    assert c.on_playout(Played(item, 1300.0, 0.0), 1500) == []  # a late report: ignored


def test_a_flush_after_everything_was_heard_truncates_nothing() -> None:
    c = core()
    _answered(c, started=0, ended=100)
    item = c.items.last_item
    assert item is not None
    c.on_playout(Played(item, 2980.0, 0.0), 3100)
    assert c.on_playout(Flushed(), 3200) == []
    closed = core()
    _answered(closed, started=0, ended=100)
    closed.close("client")
    assert closed.on_playout(Flushed(), 200) == []
