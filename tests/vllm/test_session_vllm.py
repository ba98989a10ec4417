"""A full realtime session on the GPU-path pipeline: real server, Whisper ASR (CPU), the vLLM
AR stage (vLLM's CPU build), piper TTS (CPU), over a real WebSocket (configs/cpu-vllm.yaml)."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import soundfile

from audio_kit.pcm import resample_pcm16
from tests.server.harness import ROOT, Client, running_server, send_audio, silence, text_item

pytestmark = pytest.mark.vllm


def _spoken(done: dict[str, object]) -> str:
    response = done["response"]
    assert isinstance(response, dict)
    return str(response["output"][0]["content"][0]["transcript"])


def test_realtime_session_completes_turns_on_vllm() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    data, rate = soundfile.read(ROOT / "tests" / "data" / "beckett.wav", dtype="int16")
    speech = resample_pcm16(data.tobytes()[: rate * 2 * 4], rate, 24000)  # first 4 s
    started = time.perf_counter()
    with running_server(ROOT / "configs" / "cpu-vllm.yaml", ready_s=300) as addr:
        print(f"\nserver with vLLM ready in {time.perf_counter() - started:.1f} s")

        async def run() -> None:
            async with Client.connect(addr) as c:
                await c.until("session.created", 30)
                # Turn 1, by voice: server VAD -> Whisper -> vLLM -> segmenter -> piper.
                await send_audio(c, silence(300) + speech + silence(1500))
                await c.until("input_audio_buffer.speech_started", 30)
                done = await c.until("response.done", 120)
                response = done["response"]
                assert response["status"] == "completed" or (
                    response["status_details"]["reason"] == "max_output_tokens"
                ), response
                heard = next(
                    e["transcript"]
                    for e in c.events
                    if e["type"] == "conversation.item.input_audio_transcription.completed"
                )
                # the server VAD ends the turn at the pause after the first phrase (the
                # rest of the 4 s is a turn of its own, talking over the reply)
                assert heard.lower().startswith("ever tried"), heard
                audio = [e for e in c.events if e["type"] == "response.output_audio.delta"]
                assert audio and response["audio_ms"] > 200
                assert _spoken(done).strip()
                # Turn 2, by text, on the same session: its history now holds turn 1.
                first = len(c.events)
                await c.send(text_item("What is the capital of France?"))
                await c.send({"type": "response.create"})
                done = await c.until("response.done", 120)
                assert done["response"]["status"] in ("completed", "incomplete")
                audio = [e for e in c.events[first:] if e["type"] == "response.output_audio.delta"]
                assert audio and _spoken(done).strip()
                print("turn 1 heard:", heard, "| replies:", _spoken(done)[:80])

        asyncio.run(run())
