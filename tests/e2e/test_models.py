"""One audio turn with the real embedded CPU models (configs/cpu.yaml)."""

from __future__ import annotations

import asyncio
import os

import pytest
import soundfile

from engine.audio import resample_pcm16
from tests.server.harness import ROOT, Client, running_server, send_audio, silence

pytestmark = pytest.mark.models


def test_real_models_audio_turn() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    data, rate = soundfile.read(ROOT / "tests" / "data" / "beckett.wav", dtype="int16")
    speech = resample_pcm16(data.tobytes()[: rate * 2 * 4], rate, 24000)  # first 4 s
    with running_server(ROOT / "configs" / "cpu.yaml", ready_s=300) as addr:

        async def run() -> None:
            async with Client.connect(addr) as c:
                await c.until("session.created", within=30)
                await send_audio(c, silence(300) + speech + silence(1500))
                await c.until("input_audio_buffer.speech_started", within=30)
                done = await c.until("response.done", within=120)
                status = (done["response"]["status"], done["response"]["status_details"])
                # a long model answer may be cut at max_output_tokens: still a full turn
                assert status[0] == "completed" or status[1]["reason"] == "max_output_tokens"
                transcript = next(
                    e["transcript"]
                    for e in c.events
                    if e["type"] == "conversation.item.input_audio_transcription.completed"
                )
                assert len(transcript.split()) >= 3
                audio = [e for e in c.events if e["type"] == "response.output_audio.delta"]
                assert audio and done["response"]["audio_ms"] > 200
                spoken = done["response"]["output"][0]["content"][0]["transcript"]
                assert spoken.strip()
                # the timeline on response.done (docs/protocol.md §5.2), in order
                timing = done["response"]["timing"]
                seg, at = timing["segments_ms"], timing["moments_ms"]
                assert {"silence_wait", "asr", "llm", "tts", "send", "server_total"} <= set(seg)
                assert all(v >= 0 for v in seg.values()), timing
                assert 0 < at["speech_stopped"] <= at["transcript_ready"] <= at["first_audio"]
                assert at["first_audio"] <= at["first_audio_sent"] == seg["server_total"]

        asyncio.run(run())
