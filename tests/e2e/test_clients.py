"""Unmodified third-party clients against our server: the official openai SDK and wscat."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time

import pytest
from openai import AsyncOpenAI

from tests.server.harness import ROOT, UNIT, b64, silence, tone

WSCAT = ROOT / "clients" / "node_modules" / ".bin" / "wscat"


def _client(addr: str) -> AsyncOpenAI:
    return AsyncOpenAI(
        api_key="unused", base_url=f"http://{addr}/v1", websocket_base_url=f"ws://{addr}/v1"
    )


def test_openai_sdk_text_turn(server: str) -> None:
    async def run() -> None:
        client = _client(server)
        async with client.realtime.connect(model="duplex") as conn:
            await conn.session.update(session={"type": "realtime", "output_modalities": ["text"]})
            await conn.conversation.item.create(
                item={
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "hello"}],
                }
            )
            await conn.response.create()
            text = ""
            async with asyncio.timeout(10 * UNIT):
                async for event in conn:
                    if event.type == "response.output_text.delta":
                        text += event.delta
                    elif event.type == "response.done":
                        assert event.response.status == "completed"
                        break
            assert text.startswith("Hello there.")
        await client.close()

    asyncio.run(run())


def test_openai_sdk_audio_turn(server: str) -> None:
    async def run() -> None:
        client = _client(server)
        async with client.realtime.connect(model="duplex") as conn:
            await conn.session.update(
                session={
                    "type": "realtime",
                    "audio": {
                        "input": {
                            "format": {"type": "audio/pcm", "rate": 24000},
                            "turn_detection": {"type": "server_vad", "silence_duration_ms": 400},
                        }
                    },
                }
            )
            pcm = silence(200) + tone(600) + silence(800)
            step = 24000 * 2 // 25
            for i in range(0, len(pcm), step):
                await conn.input_audio_buffer.append(audio=b64(pcm[i : i + step]))
            seen: list[str] = []
            audio_bytes = 0
            async with asyncio.timeout(10 * UNIT):
                async for event in conn:
                    seen.append(event.type)
                    if event.type == "response.output_audio.delta":
                        audio_bytes += len(event.delta)
                    if event.type == "response.done":
                        assert event.response.status == "completed"
                        break
            assert "input_audio_buffer.speech_started" in seen
            assert "conversation.item.input_audio_transcription.completed" in seen
            assert audio_bytes > 0
        await client.close()

    asyncio.run(run())


@pytest.mark.skipif(not WSCAT.exists() or shutil.which("node") is None, reason="npm install")
def test_wscat_text_session(server: str) -> None:
    lines = [
        {"type": "session.update", "session": {"output_modalities": ["text"]}},
        {
            "type": "conversation.item.create",
            "item": {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "hi"}],
            },
        },
        {"type": "response.create"},
    ]
    proc = subprocess.Popen(
        [str(WSCAT), "-c", f"ws://{server}/v1/realtime"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        seen: list[str] = []
        deadline = time.monotonic() + 15 * UNIT

        def read_until(kind: str) -> None:
            assert proc.stdout is not None
            while time.monotonic() < deadline:
                line = proc.stdout.readline()
                if not line:
                    raise AssertionError(f"wscat ended; saw {seen}")
                start = line.find("{")
                if start < 0:
                    continue
                event = json.loads(line[start:])
                seen.append(event["type"])
                if event["type"] == kind:
                    return
            raise AssertionError(f"no {kind}; saw {seen}")

        read_until("session.created")
        for obj in lines:
            proc.stdin.write(json.dumps(obj) + "\n")
            proc.stdin.flush()
        read_until("response.done")
        assert "response.output_text.delta" in seen
        assert "error" not in seen
    finally:
        proc.stdin.close()
        proc.terminate()
        proc.wait(5 * UNIT)
        proc.stdout.close()
