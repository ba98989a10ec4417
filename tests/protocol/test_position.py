"""The session's engine position and turn timeline, each alone (protocol/position.py,
protocol/timeline.py)."""

from __future__ import annotations

from duplex_contract.fence import Fence
from duplex_server.protocol.position import EnginePosition
from duplex_server.protocol.timeline import TurnTimeline

SID = "sess_0123456789abcdef0123456789abcdef"


def test_a_cancel_advances_the_epoch_by_one_and_says_which_it_cancelled() -> None:
    p = EnginePosition(SID)
    assert p.fence == Fence(SID, 0, 0, 0)
    assert p.advance() == 0 and p.epoch == 1
    assert p.advance() == 1 and p.fence_for(0) == Fence(SID, 0, 0, 0)


def test_call_results_move_the_counters_forward_only() -> None:
    p = EnginePosition(SID)
    p.accepted(Fence(SID, 0, 2, 1))
    assert (p.epoch, p.turn_id, p.response_seq) == (0, 2, 1)
    p.accepted(Fence(SID, 0, 1, 5))  # an older call's result: the counters stay
    assert (p.turn_id, p.response_seq) == (2, 1)
    p.accepted(Fence(SID, 3, 2, 2))  # the engine moved the epoch on (a cancel it decided)
    assert p.fence == Fence(SID, 3, 2, 2)
    p.accepted(Fence(SID, 1, 2, 2))
    assert p.epoch == 3


def test_a_session_taken_over_continues_at_the_engines_position() -> None:
    p = EnginePosition(SID)
    p.adopt(Fence(SID, 4, 7, 6))
    assert p.fence == Fence(SID, 4, 7, 6)


def test_the_turn_moments_are_taken_once_by_the_answer() -> None:
    t = TurnTimeline()
    t.speech_ended(last_voice_ms=900.0, now_ms=1500.0)
    t.transcript_ready(1700.0)
    t.transcript_ready(1800.0)  # the first one counts
    moments = {"last_voice": 900.0, "speech_stopped": 1500.0, "transcript_ready": 1700.0}
    assert t.take_moments() == moments
    assert t.take_moments() == {}


def test_the_idle_timeout_fires_once_per_silence_after_an_answer() -> None:
    t = TurnTimeline()
    assert t.idle_since(10_000.0, 1000.0) is None  # no answer yet: not armed
    t.answer_ended(2000.0)  # the answer's audio ends at 2 s
    assert t.idle_since(2500.0, 1000.0) is None
    assert t.idle_since(3000.0, 1000.0) == 2000.0
    assert t.idle_since(9000.0, 1000.0) is None  # fired: disarmed
    t.answer_ended(10_000.0)
    t.silence_broken()  # the user spoke
    assert t.idle_since(20_000.0, 1000.0) is None
