"""The caller's language: a French question spoken by eSpeak NG, transcribed by the real
Whisper-base in a live session that set ``audio.input.transcription.language: "fr"``
(real server on 127.0.0.1, real WebSocket client, configs/cpu.yaml)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from typing import Any

import pytest

from audio_kit.pcm import resample_pcm16
from engine.stages.tts_espeak import EspeakOptions, EspeakTts
from tests.server.harness import ROOT, Client, running_server, send_audio, silence
from tests.stages.helpers import wer

pytestmark = pytest.mark.models

QUESTION = "Bonjour. Est-ce que je peux avoir un café, s'il vous plaît ?"


@pytest.fixture(scope="module")
def cpu_server() -> Iterator[str]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with running_server(ROOT / "configs" / "cpu.yaml", ready_s=300) as addr:
        yield addr


def french_question() -> bytes:
    """The question in eSpeak NG's French voice (slow: 100 words a minute), PCM16 24 kHz."""
    tts = EspeakTts(EspeakOptions(voice="fr", words_per_minute=100), "tts-fr")
    tts.load()
    pcm = tts.synthesize(QUESTION, speed=1.0, keep_going=lambda: True)
    return resample_pcm16(pcm, tts.native_rate, 24000)


async def turn(addr: str, speech: bytes, session: dict[str, Any]) -> tuple[str, Client]:
    """One spoken turn; returns its transcript and the client (its events)."""
    async with Client.connect(addr) as c:
        created = await c.until("session.created", within=30)
        assert created["session"]["audio"]["input"]["transcription"] == {"language": "en"}
        td = {"type": "server_vad", "silence_duration_ms": 1000}
        base = {"output_modalities": ["text"], "max_output_tokens": 8}
        patch = {**base, **session, "audio": {"input": {"turn_detection": td, **session}}}
        patch.pop("transcription", None)
        await c.send({"type": "session.update", "session": patch})
        await c.until("session.updated", within=30)
        await send_audio(c, silence(300) + speech + silence(1500))
        done = await c.until("conversation.item.input_audio_transcription.completed", within=120)
        finished = await c.until("response.done", within=120)
        # usage with the real models (docs/protocol.md §5.11): the prompt and the answer's
        # tokens as llama.cpp counts them (at most max_output_tokens), and the turn's audio:
        # at least its speech and the silence window that ended it, at most all that was sent
        usage = finished["response"]["usage"]
        assert usage["input_token_details"]["text_tokens"] > 10
        assert 0 < usage["output_token_details"]["text_tokens"] <= 8
        started = next(e for e in c.events if e["type"] == "input_audio_buffer.speech_started")
        stopped = next(e for e in c.events if e["type"] == "input_audio_buffer.speech_stopped")
        turn_s = (stopped["audio_end_ms"] - started["audio_start_ms"] + 1000) / 1000
        sent_s = 0.3 + len(speech) / 48000 + 1.5
        assert turn_s - 0.05 <= usage["input_audio_seconds"] <= sent_s
        return done["transcript"], c


def test_a_french_question_is_transcribed_in_french(cpu_server: str) -> None:
    speech = french_question()

    async def run() -> None:
        fr = {"transcription": {"model": "whisper-1", "language": "fr"}}
        heard, c = await turn(cpu_server, speech, fr)
        updated = next(e for e in c.events if e["type"] == "session.updated")
        assert updated["session"]["audio"]["input"]["transcription"] == {"language": "fr"}
        assert wer(QUESTION, heard) <= 0.2, heard
        # the transcript deltas while the user speaks are French too: the speculative
        # transcript of a pause (Whisper, in the session's language); the live partials'
        # model (pocketsphinx en-us) is not fed a French session
        deltas = [
            e["delta"]
            for e in c.events
            if e["type"] == "conversation.item.input_audio_transcription.delta"
        ]
        assert wer(QUESTION, "".join(deltas)) <= 0.2, deltas

    asyncio.run(run())
