"""One audio turn with the real embedded CPU models (configs/cpu.yaml)."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from typing import Any

import pytest
import soundfile

from audio_kit.pcm import resample_pcm16
from tests.server.harness import ROOT, Client, running_server, send_audio, silence

pytestmark = pytest.mark.models


@pytest.fixture(scope="module")
def cpu_server() -> Iterator[str]:
    """One real server on configs/cpu.yaml for the tests of this module."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with running_server(ROOT / "configs" / "cpu.yaml", ready_s=300) as addr:
        yield addr


def test_real_models_audio_turn(cpu_server: str) -> None:
    data, rate = soundfile.read(ROOT / "tests" / "data" / "beckett.wav", dtype="int16")
    speech = resample_pcm16(data.tobytes()[: rate * 2 * 4], rate, 24000)  # first 4 s
    addr = cpu_server

    async def run() -> None:
        async with Client.connect(addr) as c:
            await c.until("session.created", within=30)
            # the first 4 s hold three phrases with ~0.7 s pauses between them: a 1 s silence
            # window keeps them one turn (with the default 500 ms each pause ends a turn)
            td = {"type": "server_vad", "silence_duration_ms": 1000}
            await c.send(
                {"type": "session.update", "session": {"audio": {"input": {"turn_detection": td}}}}
            )
            await c.until("session.updated", within=30)
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


def test_real_model_forced_tool_call_round_trip(cpu_server: str) -> None:
    """The official openai SDK drives a forced call on SmolLM2 (llama.cpp grammar): the
    arguments are JSON that validates against the schema; the result goes back and the
    model answers with text that uses it."""
    import jsonschema
    from openai import AsyncOpenAI

    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 40},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    }
    tool = {"type": "function", "name": "get_weather", "description": "Weather of a city"}
    addr = cpu_server

    async def run() -> None:
        client = AsyncOpenAI(
            api_key="unused", base_url=f"http://{addr}/v1", websocket_base_url=f"ws://{addr}/v1"
        )
        async with client.realtime.connect(model="duplex") as conn:
            await conn.session.update(
                session={
                    "type": "realtime",
                    "output_modalities": ["text"],
                    "tools": [{**tool, "parameters": schema}],  # type: ignore[list-item]
                    "tool_choice": {"type": "function", "name": "get_weather"},
                    "audio": {"input": {"turn_detection": None}},
                }
            )
            await conn.conversation.item.create(
                item={
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "Weather in Paris?"}],
                }
            )
            await conn.response.create()
            deltas: list[str] = []
            async with asyncio.timeout(120):
                async for event in conn:
                    if event.type == "response.function_call_arguments.delta":
                        deltas.append(event.delta)
                    elif event.type == "response.done":
                        response = event.response
                        break
            assert response.status == "completed", response.status_details
            call = (response.output or [])[0]
            assert call.type == "function_call" and call.name == "get_weather"
            assert call.arguments == "".join(deltas)
            jsonschema.validate(json.loads(call.arguments or ""), schema)
            await conn.conversation.item.create(
                item={
                    "type": "function_call_output",
                    "call_id": call.call_id or "",
                    "output": '{"temperature": 21, "sky": "sunny"}',
                }
            )
            await conn.response.create(response={"tool_choice": "none"})
            async with asyncio.timeout(120):
                async for event in conn:
                    if event.type == "response.done":
                        response = event.response
                        break
            assert response.status in ("completed", "incomplete")
            item = (response.output or [])[0]
            assert item.type == "message"
            text = (item.content or [])[0].text or ""  # type: ignore[union-attr]
            # an answer that uses the result, not the call JSON again (the prompt after a
            # function_call_output: engine/orchestration/history.py, "Tools and deletion")
            assert "21" in text and "{" not in text and "get_weather" not in text, text
        await client.close()

    asyncio.run(run())


def test_batch_speech_has_no_pause_inside_a_sentence(cpu_server: str) -> None:
    """POST /v1/audio/speech with Piper: one sentence is spoken in one piece. (The live
    answer's early first clause once split it here too: "Full duplex means both." then 0.25 s
    of silence, then "sides can talk at once.")

    Piper draws its durations at random, so the sentence's own gaps between words vary: the
    longest measured 70-150 ms over 40 syntheses (the old bound, under 150 ms, failed a CI
    run at exactly 150). Each of three syntheses must stay under 200 ms: above the voice's
    own gaps, below the 250 ms the split added."""
    import io

    import httpx
    import numpy as np

    body = {
        "model": "tts-1",
        "input": "Full duplex means both sides can talk at the same time.",
        "voice": "alloy",
        "response_format": "wav",
    }
    for _ in range(3):
        resp = httpx.post(f"http://{cpu_server}/v1/audio/speech", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        audio, rate = soundfile.read(io.BytesIO(resp.content), dtype="float32")
        win = rate // 100  # 10 ms windows
        rms = np.sqrt(np.convolve(audio**2, np.ones(win) / win, mode="same"))[::win]
        voiced = np.nonzero(rms > 0.02 * rms.max())[0]
        inside = rms[voiced[0] : voiced[-1] + 1] > 0.02 * rms.max()
        longest, run = 0, 0
        for v in inside:
            run = 0 if v else run + 1
            longest = max(longest, run)
        assert longest * 10 < 200, f"a {longest * 10} ms pause inside the sentence"


async def _live(c: Client, pcm: bytes, rate: int = 24000) -> list[tuple[float, dict[str, Any]]]:
    """Stream ``pcm`` as a microphone does (20 ms frames in real time) while recording every
    event with the time it arrived (s, on the clock ``send`` started at 0)."""
    import base64
    import time

    step = rate // 50 * 2
    got: list[tuple[float, dict[str, Any]]] = []
    t0 = time.monotonic()

    async def receive() -> None:
        while True:
            event = json.loads(await c.ws.recv())
            got.append((time.monotonic() - t0, event))

    reader = asyncio.create_task(receive())
    try:
        for n, i in enumerate(range(0, len(pcm), step)):
            await asyncio.sleep(max(0.0, t0 + n * 0.02 - time.monotonic()))
            audio = base64.b64encode(pcm[i : i + step]).decode()
            await c.send({"type": "input_audio_buffer.append", "audio": audio})
        await asyncio.sleep(1.0)
    finally:
        reader.cancel()
    return got


def test_end_of_turn_words_ends_a_finished_sentence_soon_and_waits_through_a_hesitation(
    cpu_server: str,
) -> None:
    """semantic_vad with ``end_of_turn: words`` on the real models: a finished question
    (tests/data/questions.wav's "What is the capital of Germany?") ends well before the
    1.5 s silence window, once the pause's guess has its words; a 0.8 s hesitation in the
    human recording after "... it was the worst of" keeps the turn (its words end in "of"),
    where server_vad's 500 ms ends it."""

    def clip(name: str, a: float, b: float) -> bytes:
        data, rate = soundfile.read(ROOT / "tests" / "data" / name, dtype="int16")
        return resample_pcm16(data[int(a * rate) : int(b * rate)].tobytes(), rate, 24000)

    import numpy as np

    question = clip("questions.wav", 0.2, 2.4)
    finished = silence(500) + question + silence(2500)
    cities = ("two_cities.wav", 0.0, 3.44), ("two_cities.wav", 3.44, 4.1)
    hesitant = silence(500) + clip(*cities[0]) + silence(800) + clip(*cities[1]) + silence(2500)

    async def run() -> None:
        async with Client.connect(cpu_server) as c:
            await c.until("session.created", within=30)
            td = {"type": "semantic_vad", "end_of_turn": "words", "create_response": False}
            await c.send(
                {"type": "session.update", "session": {"audio": {"input": {"turn_detection": td}}}}
            )
            up = await c.until("session.updated", within=30)
            got = up["session"]["audio"]["input"]["turn_detection"]
            assert (got["end_of_turn"], got["silence_duration_ms"]) == ("words", 1500)
            events = await _live(c, finished)
            stops = [t for t, e in events if e["type"] == "input_audio_buffer.speech_stopped"]
            # the question's last voiced 10 ms (above 5% of its loudest), as sent (s)
            x = np.frombuffer(question, "<i2").astype(np.float64)
            rms = np.sqrt(np.mean(x[: len(x) // 240 * 240].reshape(-1, 240) ** 2, axis=1))
            speech_end = 0.5 + (np.nonzero(rms > 0.05 * rms.max())[0][-1] + 1) / 100
            assert len(stops) == 1, events
            # the window would stop it >= 1.5 s after the speech; the words ~0.3-0.6 s
            assert stops[0] - speech_end < 1.2, (stops, speech_end)
            words = [
                e["transcript"]
                for _, e in events
                if e["type"] == "conversation.item.input_audio_transcription.completed"
            ]
            assert words and "capital" in str(words[0]).lower()
            events = await _live(c, hesitant)
            stopped = [e for _, e in events if e["type"] == "input_audio_buffer.speech_stopped"]
            assert len(stopped) == 1, [e["type"] for _, e in events]  # one turn, not two
            words = [
                str(e["transcript"]).lower()
                for _, e in events
                if e["type"] == "conversation.item.input_audio_transcription.completed"
            ]
            assert len(words) == 1 and "worst" in words[0] and words[0].count("times") >= 2

    asyncio.run(run())
