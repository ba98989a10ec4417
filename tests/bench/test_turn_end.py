"""The turn-end bench (bench/turn_end.py): its labelled set and its measurement, on a few of
the shipped recordings (Whisper-base for the word times, Silero VAD, Smart Turn; no TTS)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from audio_kit.smart_turn import SmartTurn
from bench.turn_end import (
    Detector,
    WordsJudge,
    at_rate,
    default_name,
    detectors,
    measure,
    pcm16,
    run,
    turn_end,
    vad_probabilities,
)
from bench.turn_end_set import (
    HUMAN,
    LEAD_S,
    PAUSE_S,
    RATE,
    SENTENCES,
    TAIL_S,
    VOICES,
    Turn,
    Utterance,
    build,
    complete_turn,
    cut_turn,
    human,
    paused_turn,
    turns_of,
    whisper_model,
)
from duplex_server.protocol.events import TurnDetection
from duplex_server.session.input_processor import SEMANTIC_CHECK_MS, SEMANTIC_PLAIN_WAIT_MS

pytestmark = pytest.mark.models

TWO_CITIES = "It was the best of times, ... the age of foolishness."
FOOLISHNESS = "it was the age of foolishness."
TEXTS = [
    TWO_CITIES,
    "Ever tried.",
    "It was the best of times,",
    "What color is grass?",
    "What is the capital of Germany?",
    FOOLISHNESS,
]


@pytest.fixture(scope="module")
def utts() -> dict[str, Utterance]:
    return {u.text: u for u in human(whisper_model(), TEXTS)}


def _rms(x: np.ndarray, a: float, b: float) -> float:
    seg = x[int(a * RATE) : int(b * RATE)].astype(np.float64)
    return float(np.sqrt(np.mean(seg**2)))


def _server(ms: int) -> TurnDetection:
    return TurnDetection(silence_duration_ms=ms)


def _end(turn: Turn, td: TurnDetection) -> float | None:
    pcm = pcm16(turn.audio)
    return turn_end(td, pcm, vad_probabilities(pcm))


def test_the_full_set_has_three_turns_per_utterance_and_over_200() -> None:
    n = len(HUMAN) + len(VOICES) * len(SENTENCES)
    assert all(len(s.split()) >= 2 for s in SENTENCES)  # every one has a word boundary
    assert 3 * n >= 200


def test_the_set_is_labelled_by_construction_and_deterministic(
    utts: dict[str, Utterance],
) -> None:
    mine = list(utts.values())
    turns = build(7, mine)
    assert len(turns) == 3 * len(mine)
    assert [t.kind for t in turns] == ["complete", "cut", "paused"] * len(mine)
    again = build(7, mine)
    assert all(np.array_equal(a.audio, b.audio) for a, b in zip(turns, again, strict=True))
    other = build(8, mine)
    assert any(a.pause_s != b.pause_s for a, b in zip(turns, other, strict=True))
    for t in turns:
        tail = t.audio[int((t.speech_end_s + 0.1) * RATE) :]
        assert len(tail) / RATE >= TAIL_S - 0.15
        # light noise after the speech, not digital silence, and far below the speech
        assert 0.0005 < float(np.sqrt(np.mean(tail.astype(np.float64) ** 2))) < 0.003
        assert _rms(t.audio, 0, LEAD_S - 0.05) < 0.003
        if t.kind == "paused":
            assert t.pause_s is not None and PAUSE_S[0] <= t.pause_s <= PAUSE_S[1]


def test_a_cut_turn_stops_at_a_word_boundary(utts: dict[str, Utterance]) -> None:
    u = utts[TWO_CITIES]
    for i, at in u.boundaries:
        left, right = u.words[i], u.words[i + 1]
        # between the middles of the two words, within Whisper's slack of its times
        assert (left.start + left.end) / 2 <= at <= (right.start + right.end) / 2
        assert min(left.end, right.start) - 0.08 <= at <= max(left.end, right.start) + 0.08
    b = 5  # after "times," (the first comma pause)
    t = cut_turn(u, b, seed=1)
    assert t.text.split() == [w.text for w in u.words[:6]] and t.text.endswith("times,")
    assert t.cut_at_s == pytest.approx(LEAD_S + u.boundaries[b][1])
    assert t.speech_end_s <= t.cut_at_s
    assert _rms(t.audio, t.cut_at_s + 0.01, t.cut_at_s + 2.0) < 0.003  # nothing after the cut
    assert _rms(t.audio, t.cut_at_s - 0.5, t.cut_at_s) > 0.02  # speech before it


def test_a_paused_turn_pauses_where_it_says(utts: dict[str, Utterance]) -> None:
    u = utts["It was the best of times,"]
    done = complete_turn(u, seed=1)
    t = paused_turn(u, 2, 0.8, seed=1)  # after "the"
    assert t.pause_at_s == pytest.approx(LEAD_S + u.boundaries[2][1])
    assert t.pause_at_s is not None and t.pause_s == 0.8
    assert _rms(t.audio, t.pause_at_s + 0.01, t.pause_at_s + 0.79) < 0.003
    assert _rms(t.audio, t.pause_at_s - 0.2, t.pause_at_s) > 0.02
    assert _rms(t.audio, t.pause_at_s + 0.8, t.pause_at_s + 1.0) > 0.02
    assert t.speech_end_s == pytest.approx(done.speech_end_s + 0.8, abs=0.01)
    assert len(t.audio) == len(done.audio) + int(0.8 * RATE)


def test_server_vad_200_cuts_two_cities_at_its_commas_1000_does_not(
    utts: dict[str, Utterance],
) -> None:
    t = complete_turn(utts[TWO_CITIES], seed=1)
    short = measure(t, _end(t, _server(200)))
    # at a comma pause mid-sentence (Silero hears the breath in the first: the second, ~0.35 s
    # below its threshold, is enough for 200 ms)
    assert short["cutoff"] and short["end_s"] < t.speech_end_s - 2.0
    long = measure(t, _end(t, _server(1000)))
    assert not long["cutoff"]
    assert 1000 <= long["dead_air_ms"] <= 1300  # the window, plus Silero's hangover


def test_dead_air_of_a_complete_turn_is_about_the_window(utts: dict[str, Utterance]) -> None:
    t = complete_turn(utts["Ever tried."], seed=1)
    pcm = pcm16(t.audio)
    probs = vad_probabilities(pcm)
    dead = {w: measure(t, turn_end(_server(w), pcm, probs))["dead_air_ms"] for w in (300, 700)}
    for w, ms in dead.items():  # Silero drops below its threshold near the last voiced sample
        assert w - 100 <= ms <= w + 300
    assert dead[700] - dead[300] == pytest.approx(400, abs=40)


def test_a_hesitation_is_a_false_cutoff_for_a_short_window_only(
    utts: dict[str, Utterance],
) -> None:
    t = paused_turn(utts["What color is grass?"], 1, 0.6, seed=3)
    assert measure(t, _end(t, _server(300)))["cutoff"]
    assert not measure(t, _end(t, _server(1000)))["cutoff"]


def test_the_run_summarizes_per_family_and_picks_the_best_setting(
    utts: dict[str, Utterance],
) -> None:
    turns = turns_of(utts["It was the best of times,"], random.Random(1), 1)
    dets = [d for d in detectors() if d.name in ("server_vad_200", "server_vad_1000")]
    out = run(turns, dets)
    fam = out["detectors"]["server_vad"]
    assert set(fam["settings"]) == {"server_vad_200", "server_vad_1000"}
    assert "false_cutoff_pct" not in fam  # its default setting (500 ms) was not run
    s = fam["settings"]["server_vad_1000"]
    assert s["turns"] == {"complete": 1, "cut": 1, "paused": 1} and s["missed"] == 0
    assert s["dead_air_ms_p50"] is not None and s["dead_air_ms_p50"] >= 1000
    assert len(out["rows"]["server_vad_200"]) == 3
    assert set(s["by_source"]) == {"human"}
    assert s["by_source"]["human"]["dead_air_ms_p50"] == s["dead_air_ms_p50"]


def test_semantic_vad_ends_a_finished_sentence_at_its_check(utts: dict[str, Utterance]) -> None:
    """'it was the age of foolishness.' sounds finished (tests/stages/test_semantic_vad.py):
    medium ends it at the 200 ms check, low (0.98) after the plain 500 ms, as server_vad."""
    t = complete_turn(utts[FOOLISHNESS], seed=1)
    dets = [d for d in detectors() if d.name in ("semantic_vad_medium", "semantic_vad_low")]
    score = SmartTurn.shared().probability
    out = run([t], dets)
    assert SmartTurn.shared().probability == score  # the memo is gone after the run
    dead = {n: rows[0]["dead_air_ms"] for n, rows in out["rows"].items()}
    fam = out["detectors"]["semantic_vad"]
    assert fam["default_setting"] == "semantic_vad_medium" and fam["false_cutoff_pct"] is None
    assert dead["semantic_vad_medium"] <= SEMANTIC_CHECK_MS + 200
    assert SEMANTIC_PLAIN_WAIT_MS <= dead["semantic_vad_low"] <= SEMANTIC_PLAIN_WAIT_MS + 250


def test_at_rate_takes_the_lowest_dead_air_within_the_rate() -> None:
    settings = {
        "a": {"false_cutoff_pct": 20.0, "dead_air_ms_p50": 300.0},
        "b": {"false_cutoff_pct": 8.0, "dead_air_ms_p50": 600.0},
        "c": {"false_cutoff_pct": 4.0, "dead_air_ms_p50": 900.0},
        "d": {"false_cutoff_pct": 0.0, "dead_air_ms_p50": 1200.0},
    }
    assert at_rate(settings, 5) == (900.0, "c")
    assert at_rate(settings, 10) == (600.0, "b")
    assert at_rate(settings, 1) == (1200.0, "d")
    assert at_rate({"a": settings["a"]}, 5) == (None, None)


def test_the_detectors_are_the_session_s() -> None:
    dets = {d.name: d for d in detectors()}
    assert default_name() == "server_vad_500" and default_name() in dets
    assert dets["server_vad_500"].td == TurnDetection()
    sem = dets["semantic_vad_low"]
    assert isinstance(sem, Detector) and sem.td.type == "semantic_vad"
    assert sem.td.silence_duration_ms == 3000  # the eagerness's longest wait


@pytest.fixture(scope="module")
def judge() -> WordsJudge:
    return WordsJudge()


def test_words_end_a_finished_sentence_at_its_verdict_and_keep_a_hesitation(
    utts: dict[str, Utterance], judge: WordsJudge
) -> None:
    """end_of_turn: words: "What is the capital of Germany?" ends once its pause's words are judged
    (the verdict's measured compute counted), well before medium's 1.5 s window; a 0.8 s
    hesitation after "It was the" waits (its words end in "the"), as does the same sentence
    where the words are not judged at all (the 1500 ms window)."""
    done = complete_turn(utts["What is the capital of Germany?"], seed=1)
    paused = paused_turn(utts["It was the best of times,"], 2, 0.8, seed=1)
    dets = [d for d in detectors(words=True) if d.name == "words_medium"]
    assert dets and dets[0].td.end_of_turn == "words"
    out = run([done, paused], dets, judge=judge)
    done_row, paused_row = out["rows"]["words_medium"]
    assert not done_row["cutoff"] and done_row["dead_air_ms"] < 1200, done_row
    assert not paused_row["cutoff"], paused_row
    fam = out["detectors"]["words"]
    assert fam["default_setting"] == "words_medium" and fam["false_cutoff_pct"] == 0.0
    assert judge.verdict_ms_p50() is not None and judge.verdict_ms_p50() > 0
    pcm = pcm16(done.audio)
    window = measure(done, turn_end(dets[0].td, pcm, vad_probabilities(pcm)))  # no judge
    assert window["dead_air_ms"] >= 1500 > done_row["dead_air_ms"] + 300
