"""TTS stages: output format, streaming, speed, abort, and a TTS -> Whisper round trip.

Round-trip bound: WER <= 0.2 of Whisper's transcript of the synthesized audio against the
input text (piper and espeak both come out near exact).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from duplex_contract.batch import AudioOut, TranscriptOut
from engine.messages import AsrRequest, StageDone, TtsRequest
from engine.stages.asr_whisper import WhisperAsr
from engine.stages.tts_espeak import EspeakTts
from engine.stages.tts_piper import PiperTts
from tests.stages.helpers import collect, rms_dbfs, run_request, wer

pytestmark = pytest.mark.models

SENTENCES = (
    "The quick brown fox jumps over the lazy dog. "
    "I would like a cup of coffee with milk, please. "
    "Tomorrow the weather will be sunny and warm."
)
LONG = " ".join(
    f"This is sentence number {n} of a long answer that keeps on going for a while."
    for n in ("one", "two", "three", "four", "five", "six", "seven", "eight")
)


@pytest.fixture(params=["piper", "espeak"])
def tts(request: pytest.FixtureRequest) -> PiperTts | EspeakTts:
    backend: PiperTts | EspeakTts = request.getfixturevalue(request.param)
    return backend


def test_format_rate_and_chunking(tts: PiperTts | EspeakTts) -> None:
    run = run_request(tts, TtsRequest(request_id="f", text=SENTENCES, sample_rate=24000))
    assert isinstance(run.outputs[-1], StageDone) and run.done.finish_reason == "stop"
    chunks = run.audio
    assert chunks and all(isinstance(o, AudioOut) for o in run.outputs[:-1])
    assert {c.sample_rate for c in chunks} == {24000}
    assert all(len(c.pcm) % 2 == 0 and 0 < len(c.pcm) <= 4800 for c in chunks)
    full = sum(len(c.pcm) == 4800 for c in chunks)  # exactly 100 ms
    assert full >= len(chunks) - 3  # one short remainder per sentence at most
    stamps = [c.t_ns for c in chunks]
    assert stamps == sorted(stamps) and stamps[0] > 0
    seconds = len(run.pcm) / 2 / 24000
    n_words = len(SENTENCES.split())
    assert 0.15 * n_words <= seconds <= 0.8 * n_words
    assert rms_dbfs(run.pcm) > -35.0  # not silent


@pytest.mark.parametrize("rate", [16000, 22050, 48000])
def test_other_output_rates(piper: PiperTts, rate: int) -> None:
    run = run_request(piper, TtsRequest(request_id="r", text="Good morning.", sample_rate=rate))
    assert {c.sample_rate for c in run.audio} == {rate}
    assert 0.4 <= len(run.pcm) / 2 / rate <= 2.0


def test_round_trip_through_whisper(tts: PiperTts | EspeakTts, whisper: WhisperAsr) -> None:
    pcm = run_request(tts, TtsRequest(request_id="t", text=SENTENCES, sample_rate=16000)).pcm
    run = run_request(whisper, AsrRequest(request_id="a", audio=pcm, sample_rate=16000))
    transcript = run.outputs[0]
    assert isinstance(transcript, TranscriptOut)
    assert wer(SENTENCES, transcript.text) <= 0.2, transcript.text


def test_speed_shortens_audio(tts: PiperTts | EspeakTts) -> None:
    text = "Speaking faster makes the audio shorter than before."
    normal = run_request(tts, TtsRequest(request_id="n", text=text, sample_rate=16000)).pcm
    fast = run_request(tts, TtsRequest(request_id="s", text=text, speed=1.5, sample_rate=16000))
    assert len(fast.pcm) < 0.85 * len(normal)


def test_piper_streams_sentence_by_sentence(piper: PiperTts) -> None:
    run = run_request(piper, TtsRequest(request_id="s", text=LONG[:300], sample_rate=24000))
    first_audio = run.times[0] - run.started
    total = run.times[-1] - run.started
    assert first_audio < 0.6 * total, (first_audio, total)


async def _abort_after_first_chunk(tts: PiperTts | EspeakTts) -> None:
    request = TtsRequest(request_id="abort-me", text=LONG, sample_rate=24000)
    after_abort: list[object] = []
    aborted_at = 0.0
    async for out in tts.submit(request):
        if aborted_at:
            after_abort.append(out)
        elif isinstance(out, AudioOut):
            aborted_at = time.perf_counter()
            await tts.abort([request.request_id])
    stop_latency = time.perf_counter() - aborted_at
    assert after_abort == [StageDone(request_id="abort-me", finish_reason="aborted")]
    assert stop_latency < 1.0  # the worker stops at the next chunk/sentence boundary
    # The worker is free again at once: a new request is served promptly.
    start = time.perf_counter()
    run = await collect(tts, TtsRequest(request_id="next", text="Okay.", sample_rate=24000))
    assert run.done.finish_reason == "stop" and run.audio
    assert time.perf_counter() - start < 1.5


def test_abort_stops_output(tts: PiperTts | EspeakTts) -> None:
    asyncio.run(_abort_after_first_chunk(tts))


def test_piper_runs_without_onnxruntime_s_memory_arena(piper: PiperTts) -> None:
    """The arena would keep the longest sentence's buffers for good (engine/heap.py)."""
    voice = piper._voice
    assert voice is not None
    assert voice.session.get_session_options().enable_cpu_mem_arena is False
