"""Input noise reduction (audio_kit/denoise.py) on a real recording mixed with noise at 5 dB
SNR: VAD false triggers and Whisper WER with and without it (bench/noise_reduction.py
prints the same figures). It must not make the clean recording's WER worse."""

from __future__ import annotations

import numpy as np
import pytest

from audio_kit.denoise import NoiseSuppressor
from bench.noise_reduction import PHRASES, measure
from duplex_contract.batch import TranscriptOut
from engine.messages import AsrRequest
from engine.stages.asr_whisper import WhisperAsr
from tests.stages.helpers import run_request

pytestmark = pytest.mark.models


def test_noise_reduction_vad_and_wer_at_5db(whisper: WhisperAsr) -> None:
    def transcribe(pcm: bytes) -> str:
        run = run_request(whisper, AsrRequest(request_id="n", audio=pcm, sample_rate=16000))
        return next(o.text for o in run.outputs if isinstance(o, TranscriptOut) and o.final)

    figures = measure(transcribe, 5.0, kinds=(None, "near_field"))
    print(figures)  # the report: pytest -s shows it
    off, on = figures["off"], figures["near_field"]
    # the energy VAD hears the noise as speech: one turn from the first noise sample on
    assert off["energy"]["noisy_false_triggers"] >= 1
    assert off["energy"]["noisy_onsets"] < len(PHRASES)
    # with noise reduction it finds every phrase and nothing else
    assert on["energy"]["noisy_false_triggers"] == 0
    assert on["energy"]["noisy_onsets"] == len(PHRASES)
    # Silero is robust to this noise with or without it; it must not get worse
    assert on["silero"]["noisy_false_triggers"] <= off["silero"]["noisy_false_triggers"]
    assert on["silero"]["clean_onsets"] == off["silero"]["clean_onsets"] == len(PHRASES)
    # WER: never worse on clean speech; on the noisy mix at most one word of 12 worse
    assert on["clean_wer"] <= off["clean_wer"] <= 0.25
    assert on["noisy_wer"] <= off["noisy_wer"] + 0.09
    assert 0 < on["cpu_ms_per_session_s"] < 100  # well under 10% of one core


def test_suppressor_streams_whole_frames() -> None:
    ns = NoiseSuppressor("near_field")
    rng = np.random.default_rng(1)
    pcm = (rng.standard_normal(16000) * 3000).astype("<i2").tobytes()
    out = [ns.process(pcm[i : i + 333]) for i in range(0, len(pcm), 333)]
    assert all(len(o) % 320 == 0 for o in out)
    joined = b"".join(out)
    assert len(pcm) - 320 < len(joined) <= len(pcm)  # at most 10 ms held back
    level = lambda b: float(np.sqrt(np.mean(np.frombuffer(b, "<i2").astype(float) ** 2)))  # noqa: E731
    assert level(joined[16000:]) < level(pcm[16000:]) / 2  # steady noise is suppressed
