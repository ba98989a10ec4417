"""The input processor reports a speech onset (``VadOnset``) at Silero's first window of
voice when that window is sure (``ONSET_SURE``), one 32 ms window before the speech starts
(``VadStart``, 64 ms of voice), on the shipped human recordings; a fragment of a word
that falls silent first is an onset lost (``VadOnsetLost``), never a speech. Confirm mode
pauses the answer on the onset."""

from __future__ import annotations

import numpy as np
import soundfile
import soxr

from duplex_server.protocol.codec import AudioFormat
from duplex_server.protocol.events import TurnDetection
from duplex_server.protocol.vad_events import VadEvent, VadOnset, VadOnsetLost, VadStart
from duplex_server.session.input_processor import ONSET_HOLD_MS, ONSET_SURE, InputProcessor
from tests.server.harness import ROOT


def _recording(name: str) -> np.ndarray:
    wav, rate = soundfile.read(ROOT / "tests/data" / name, dtype="float32")
    x = soxr.resample(wav, rate, 16000)
    return np.asarray(np.clip(x, -1.0, 1.0) * 32767.0, dtype="<i2")


def _events(pcm: np.ndarray) -> list[VadEvent]:
    proc = InputProcessor(AudioFormat("pcm16", 16000), TurnDetection(), "silero")
    data = pcm.tobytes()
    out: list[VadEvent] = []
    for i in range(0, len(data), 640):  # 20 ms frames, as a live client sends them
        out += proc.process(data[i : i + 640], 0.0)[1]
    return out


def test_a_speech_start_is_heard_as_an_onset_one_window_sooner_when_its_voice_is_sure() -> None:
    """On the three shipped recordings (10 speech starts), a start whose first window of
    voice scores at least ``ONSET_SURE`` (9 of them) was told as an onset 32 ms sooner; the
    other waits for its start, as before."""
    told = starts = 0
    for name in ("questions.wav", "beckett.wav", "two_cities.wav"):
        events = _events(_recording(name))
        last: VadEvent | None = None
        for e in events:
            if isinstance(e, VadStart):
                starts += 1
                assert not isinstance(last, VadOnsetLost), events
                if isinstance(last, VadOnset):
                    told += 1  # told at the end of the first window of voice
                    assert last.at_ms == e.onset_ms + 32.0
            if isinstance(e, (VadStart, VadOnset, VadOnsetLost)):
                last = e
    assert starts >= 9 and told >= starts - 1, (told, starts)


def test_a_fragment_of_a_word_is_an_onset_lost_not_a_speech() -> None:
    speech = _recording("questions.wav")
    first = next(e for e in _events(speech) if isinstance(e, VadStart))
    at = int(first.onset_ms * 16)
    silence = np.zeros(16000, dtype="<i2")
    events = _events(np.concatenate([silence, speech[at : at + 320], silence]))  # 20 ms
    assert [type(e) for e in events] == [VadOnset, VadOnsetLost]
    onset, lost = events
    assert isinstance(onset, VadOnset) and isinstance(lost, VadOnsetLost)
    assert 0 < lost.at_ms - onset.at_ms <= 96.0  # the pause on it lasts a window or two


def test_an_onset_that_hovers_between_the_thresholds_is_told_lost_in_time() -> None:
    """Silero's probability over the threshold once, then between its two thresholds
    (neither speech nor silence): the onset is told lost ``ONSET_HOLD_MS`` after it was
    heard, once; a speech that starts after it still starts."""
    proc = InputProcessor(AudioFormat("pcm16", 16000), TurnDetection(), "silero")
    chunk = np.zeros(512, dtype=np.float32)
    probs = [0.1] * 20 + [0.8] + [0.45] * 12 + [0.9, 0.9, 0.1]  # voice at 640 ms
    events = proc.events(probs, [chunk] * len(probs), 0.0)
    onset, lost, start = events[:3]
    assert isinstance(onset, VadOnset) and onset.at_ms == 672.0
    assert isinstance(lost, VadOnsetLost) and lost.at_ms == 672.0 + 32 * 7  # >= 200 ms later
    assert lost.at_ms - onset.at_ms >= ONSET_HOLD_MS > lost.at_ms - onset.at_ms - 32
    assert isinstance(start, VadStart) and start.onset_ms == 640.0
    assert not [e for e in events[3:] if isinstance(e, (VadOnset, VadOnsetLost))]
    # a first window over the threshold but less sure tells nothing: the start decides
    unsure = [0.1] * 20 + [ONSET_SURE - 0.05, 0.1, 0.1, ONSET_SURE - 0.05, 0.9, 0.1]
    proc = InputProcessor(AudioFormat("pcm16", 16000), TurnDetection(), "silero")
    events = proc.events(unsure, [chunk] * len(unsure), 0.0)
    assert [type(e) for e in events] == [VadStart]
