"""The live-vs-batch parity matrix (issue 26): each source streamed through a live session
(server VAD, pause speculation, the session's resampler or G.711 decoder) at each input
format and append size transcribes within +0.02 WER of the batch route
``POST /v1/audio/transcriptions`` on the same audio, and the same for every append size
(the engine is given the same bytes, cut at the VAD's decision points).

* sources: the two test recordings (tests/data) and six short questions spoken by the
  project's eSpeak NG stage ("What is the capital of France?" among them), streamed as one
  stream with 3 s of silence after each (a new utterance each: decoded without context)
  and sent to the batch route one file each, as a user would;
* formats: PCM16 at 16 and 24 kHz, G.711 mu-law at 8 kHz (the batch route gets the same
  mu-law-decoded samples as a WAV file);
* appends: 10, 20, 40, 100 and 200 ms.

``make test`` runs every source and format with 20 ms appends (a microphone's frame); the
other append sizes are marked ``matrix`` and run in their own tier (``make test-matrix``,
after the default tier in ``.ci/run``), each asserting one transcript for all four. One
server serves the module.

beckett.wav over G.711 mu-law said "Failed better." live against the batch route's "Fail
better." (+0.083 WER): the engine gets the same samples as the batch route (the two
resampling paths agree within 1 LSB), but Whisper-base decoded the band-limited last
phrase after the previous one in a 10 s encoder window, and mishears it there (10-12 s),
not in 13 s or more, nor inside the whole recording in 15 s (the batch route). Narrowband
audio decoded after its context now gets at least 15 s (engine/stages/whisper_decoder.py
``NARROW_CONTEXT_MIN_S``; tests/stages/test_asr.py holds the case), so the case passes.
"""

from __future__ import annotations

import asyncio
import base64
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import soundfile

from audio_kit.g711 import g711_to_pcm16, pcm16_to_g711
from audio_kit.pcm import resample_pcm16
from tests.e2e.test_live_parity import RECORDINGS, _batch, _live, _wer
from tests.server.harness import ROOT, running_server

pytestmark = pytest.mark.models

QUESTIONS = [
    "What is the capital of France?",
    "How many legs does a spider have?",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water?",
    "Can you recommend a good book?",
    "How far away is the moon?",
]
SOURCES = ("beckett", "two_cities", "questions")
FORMATS = ("pcm16@16000", "pcm16@24000", "g711_ulaw@8000")
DEFAULT = (20,)  # the append size in make test
OTHERS = (10, 40, 100, 200)  # the rest of the matrix (marker ``matrix``)
GAP = 3.0  # s of silence after each question: more than Whisper's context_max_gap_s
SPEED = 4.0  # faster than real time: the VAD judges samples, the context gap the input clock


def _questions() -> list[bytes]:
    """The questions in eSpeak NG's default voice, PCM16 16 kHz, rendered in a process of
    their own: libespeak-ng carries state from one synthesis to the next in a process (the
    same text comes out a few samples different after other speech, e.g. test_language's
    French), so rendered here they would depend on which tests ran before."""
    out = subprocess.run(
        [sys.executable, "-c", _RENDER, *QUESTIONS],
        cwd=ROOT,
        capture_output=True,
        check=True,
        timeout=120,
    ).stdout
    return [base64.b64decode(line) for line in out.split()]


_RENDER = """
import base64, sys
from audio_kit.pcm import resample_pcm16
from engine.stages.tts_espeak import EspeakOptions, EspeakTts
tts = EspeakTts(EspeakOptions(), "parity-espeak")
tts.load()
for q in sys.argv[1:]:
    pcm = tts.synthesize(q, speed=1.0, keep_going=lambda: True)
    print(base64.b64encode(resample_pcm16(pcm, tts.native_rate, 16000)).decode())
"""


@pytest.fixture(scope="module")
def sources() -> dict[str, tuple[list[bytes], str]]:
    """Source name -> (its utterances, PCM16 16 kHz: a file each for the batch route, and
    the live stream is them with GAP s of silence after each; the reference text)."""
    out = {}
    for name in ("beckett", "two_cities"):
        data, rate = soundfile.read(ROOT / "tests" / "data" / f"{name}.wav", dtype="int16")
        assert rate == 16000
        out[name] = ([data.tobytes()], RECORDINGS[f"{name}.wav"])
    out["questions"] = (_questions(), " ".join(QUESTIONS))
    return out


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with running_server(ROOT / "configs" / "cpu.yaml", ready_s=300) as addr:
        yield addr


_BATCH: dict[tuple[str, str], str] = {}


def _check(
    server: str,
    sources: dict[str, tuple[list[bytes], str]],
    source: str,
    fmt: str,
    appends: tuple[int, ...],
) -> None:
    parts, ref = sources[source]
    codec, rate_s = fmt.split("@")
    rate = int(rate_s)
    utterances = [resample_pcm16(p, 16000, rate) for p in parts]
    if (source, fmt) not in _BATCH:
        texts = []
        for pcm in utterances:
            if codec == "g711_ulaw":  # the batch route gets the samples the live decoder makes
                pcm = g711_to_pcm16(pcm16_to_g711(pcm, "g711_ulaw"), "g711_ulaw")
            texts.append(_batch(server, f"{source}.wav", np.frombuffer(pcm, "<i2"), rate))
        _BATCH[source, fmt] = " ".join(texts)
    batch = _BATCH[source, fmt]
    gap = bytes(2 * int(rate * GAP)) if len(utterances) > 1 else b""
    stream = b"".join(u + gap for u in utterances)
    lives = {ms: asyncio.run(_live(server, stream, rate, ms, SPEED, codec)) for ms in appends}
    for ms, live in lives.items():
        assert _wer(ref, live) <= _wer(ref, batch) + 0.02, (source, fmt, ms, live, batch)
    assert len(set(lives.values())) == 1, (source, fmt, lives)


def _cases() -> list[Any]:
    return [pytest.param(s, f) for s in SOURCES for f in FORMATS]


@pytest.mark.parametrize(("source", "fmt"), _cases())
def test_live_transcripts_match_the_batch_route(
    server: str, sources: dict[str, tuple[list[bytes], str]], source: str, fmt: str
) -> None:
    _check(server, sources, source, fmt, DEFAULT)


@pytest.mark.matrix
@pytest.mark.parametrize(("source", "fmt"), _cases())
def test_live_transcripts_match_the_batch_route_at_every_append_size(
    server: str, sources: dict[str, tuple[list[bytes], str]], source: str, fmt: str
) -> None:
    _check(server, sources, source, fmt, OTHERS)
