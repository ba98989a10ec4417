"""Session fixtures: each real model is loaded once (in its own worker thread) per test run."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import soundfile as sf

from engine.messages import TtsRequest
from engine.stages.asr_pocketsphinx import PocketsphinxAsr, PocketsphinxOptions
from engine.stages.asr_whisper import WhisperAsr, WhisperOptions
from engine.stages.base import StageBackend
from engine.stages.llm_llamacpp import LlamaCppLlm, LlamaCppOptions
from engine.stages.tts_espeak import EspeakOptions, EspeakTts
from engine.stages.tts_piper import PiperOptions, PiperTts
from tests.stages.helpers import run_request

os.environ.setdefault("HF_HUB_OFFLINE", "1")

DATA = Path(__file__).resolve().parent.parent / "data"


def _started(backend: StageBackend) -> Iterator[Any]:
    asyncio.run(backend.start())
    try:
        yield backend
    finally:
        asyncio.run(backend.close())


@pytest.fixture(scope="session")
def whisper() -> Iterator[WhisperAsr]:
    yield from _started(WhisperAsr(WhisperOptions(), "asr"))


@pytest.fixture(scope="session")
def pocketsphinx() -> Iterator[PocketsphinxAsr]:
    yield from _started(PocketsphinxAsr(PocketsphinxOptions(), "asr-ps"))


@pytest.fixture(scope="session")
def llm() -> Iterator[LlamaCppLlm]:
    yield from _started(LlamaCppLlm(LlamaCppOptions(), "llm"))


@pytest.fixture(scope="session")
def piper() -> Iterator[PiperTts]:
    yield from _started(PiperTts(PiperOptions(), "tts"))


@pytest.fixture(scope="session")
def espeak() -> Iterator[EspeakTts]:
    yield from _started(EspeakTts(EspeakOptions(), "tts-espeak"))


@pytest.fixture(scope="session")
def beckett() -> bytes:
    """beckett.wav as PCM16 mono 16 kHz bytes (a real human recording, 9.96 s)."""
    audio, rate = sf.read(DATA / "beckett.wav", dtype="int16")
    assert rate == 16000 and audio.ndim == 1
    return bytes(audio.tobytes())


@pytest.fixture(scope="session")
def piper_question(piper: PiperTts) -> bytes:
    """'What is the weather like today?' spoken by piper, PCM16 mono 16 kHz."""
    req = TtsRequest(request_id="q", text="What is the weather like today?", sample_rate=16000)
    return run_request(piper, req).pcm
