"""semantic_vad: Silero VAD + Smart Turn v3.2 (from the pipecat-ai wheel, not imported) on a
human recording (tests/data/two_cities.wav), through the server's input processor."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import soundfile

from audio_kit.smart_turn import SmartTurn, features, model_path
from duplex_server.protocol.codec import AudioFormat
from duplex_server.protocol.events import TurnDetection
from duplex_server.protocol.vad_events import VadEvent, VadStop
from duplex_server.session.input_processor import (
    SEMANTIC_CHECK_MS,
    SEMANTIC_PLAIN_WAIT_MS,
    InputProcessor,
)
from tests.server.harness import ROOT

pytestmark = pytest.mark.models
RATE = 16000


def _clip(*parts: tuple[float, float] | float) -> bytes:
    """Pieces of two_cities.wav (start, end in s) and silences (a float: seconds)."""
    data, rate = soundfile.read(ROOT / "tests" / "data" / "two_cities.wav", dtype="int16")
    assert rate == RATE
    out = []
    for p in parts:
        if isinstance(p, tuple):
            out.append(data[int(p[0] * RATE) : int(p[1] * RATE)])
        else:
            out.append(np.zeros(int(p * RATE), dtype=np.int16))
    return np.concatenate(out).tobytes()


def _stream(pcm: bytes, td: TurnDetection) -> list[tuple[float, VadEvent]]:
    """20 ms frames through the input processor; (audio position when decided, event)."""
    proc = InputProcessor(AudioFormat("pcm16", RATE), td, "silero")
    out: list[tuple[float, VadEvent]] = []
    pcm += bytes(2 * RATE * 2)  # 2 s of silence after the words
    for i in range(0, len(pcm), 640):
        _, events = proc.process(pcm[i : i + 640], 0.0)
        out += [((i + 640) / 32.0, e) for e in events]
    return out


def test_model_is_found_without_importing_pipecat() -> None:
    path = model_path()
    assert path.name == "smart-turn-v3.2-cpu.onnx" and path.stat().st_size > 1_000_000
    assert "pipecat" not in sys.modules
    assert features(np.zeros(RATE, dtype=np.float32)).shape == (1, 80, 800)


def test_a_pause_inside_the_sentence_does_not_end_the_turn() -> None:
    """'It was the best of times, it was the worst of' + 0.8 s + 'times,': Smart Turn hears
    an unfinished sentence (P ~ 0.02), so the turn waits; server VAD (500 ms) ends it there."""
    pcm = _clip((0.0, 3.44), 0.8, (3.44, 4.1))
    td = TurnDetection(type="semantic_vad", eagerness="auto", silence_duration_ms=1500)
    stops = [(t, e) for t, e in _stream(pcm, td) if isinstance(e, VadStop)]
    assert len(stops) == 1 and stops[0][1].audio_end_ms > 4200, stops  # after "times,"
    server = [e for _, e in _stream(pcm, TurnDetection()) if isinstance(e, VadStop)]
    assert len(server) == 2  # the false turn end semantic_vad avoids


def test_a_finished_utterance_ends_after_a_short_silence() -> None:
    """'It was the age of foolishness.': ends ~SEMANTIC_CHECK_MS into the silence, not after
    the 1500 ms an unfinished turn would wait."""
    model = SmartTurn.shared()
    pcm = _clip((5.7, 7.75))
    assert model.probability(np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768) > 0.8
    td = TurnDetection(type="semantic_vad", eagerness="auto", silence_duration_ms=1500)
    stops = [(t, e) for t, e in _stream(pcm, td) if isinstance(e, VadStop)]
    assert len(stops) == 1, stops
    decided_at, stop = stops[0]
    assert decided_at - stop.audio_end_ms <= SEMANTIC_CHECK_MS + 100, (decided_at, stop)


def test_eagerness_low_gives_a_finished_sounding_turn_the_plain_window() -> None:
    """'it was the age of wisdom,': Smart Turn calls it finished enough for `auto` (the turn
    ends at the 200 ms check), not for `low` (0.98): there it ends after the plain 500 ms,
    not after low's longest wait (3 s), since it does not sound unfinished either."""
    pcm = _clip((4.4, 5.75))
    waits = {}
    for eagerness, longest in (("auto", 1500), ("low", 3000)):
        td = TurnDetection(type="semantic_vad", eagerness=eagerness, silence_duration_ms=longest)
        stops = [(t, e) for t, e in _stream(pcm, td) if isinstance(e, VadStop)]
        assert len(stops) == 1, (eagerness, stops)
        waits[eagerness] = stops[0][0] - stops[0][1].audio_end_ms
    assert waits["auto"] <= SEMANTIC_CHECK_MS + 100, waits
    assert SEMANTIC_PLAIN_WAIT_MS <= waits["low"] <= SEMANTIC_PLAIN_WAIT_MS + 100, waits
