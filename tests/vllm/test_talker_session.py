"""The talker route end to end (configs/cpu-talker-test.yaml): a real server, Whisper ASR,
SmolLM2 on vLLM, the tiny Orpheus-layout talker on vLLM, the SNAC decoder in torch, over a
real WebSocket; then a barge-in mid-reply, checked in the client's stream and in vLLM."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import pytest
import soundfile

from audio_kit.pcm import resample_pcm16
from engine.stages.codec_snac import SnacCodec
from engine.stages.talker_vllm import VllmTalker
from tests.server import harness
from tests.server.harness import ROOT, Client, running_server, send_audio, silence

pytestmark = pytest.mark.vllm


def _stages(app: Any) -> tuple[VllmTalker, SnacCodec]:
    orch = app.state.engine.engine.orchestrator
    talker, codec = orch.pools["talker"].replicas[0], orch.pools["codec"].replicas[0]
    assert isinstance(talker, VllmTalker) and isinstance(codec, SnacCodec)
    return talker, codec


def test_talker_route_speaks_and_a_barge_in_aborts_the_talker_in_vllm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    apps: list[Any] = []
    make = harness.create_app
    monkeypatch.setattr(harness, "create_app", lambda config: apps.append(make(config)) or apps[-1])
    data, rate = soundfile.read(ROOT / "tests" / "data" / "beckett.wav", dtype="int16")
    speech = resample_pcm16(data.tobytes()[: rate * 2 * 4], rate, 24000)  # first 4 s
    started = time.perf_counter()
    with running_server(ROOT / "configs" / "cpu-talker-test.yaml", ready_s=400) as addr:
        print(
            f"\nserver with two vLLM engines + SNAC ready in {time.perf_counter() - started:.1f} s"
        )
        talker, codec = _stages(apps[0])

        async def run() -> None:
            async with Client.connect(addr) as c:
                await c.until("session.created", 30)
                # A spoken turn: VAD -> Whisper -> SmolLM2 -> segmenter -> talker -> SNAC.
                await send_audio(c, silence(300) + speech + silence(1500))
                await c.until("input_audio_buffer.speech_started", 30)
                first = await c.until("response.output_audio.delta", 120)
                rid = first["response_id"]
                # the talker is mid-reply: vLLM holds this response's talker request
                held: list[str] = []
                for _ in range(100):
                    held = await talker.engine.held_request_ids()
                    if any("/talker" in h for h in held):
                        break
                    await asyncio.sleep(0.05)
                old = [h for h in held if "/talker" in h]
                assert old, f"no talker request in vLLM mid-reply: {held}"
                await c.until("response.output_audio.delta", 60)
                # Barge-in: the user talks over the reply.
                await send_audio(c, speech[: 24000 * 2 * 2])
                done = await c.until("response.done", 60)
                while done["response"]["id"] != rid:
                    done = await c.until("response.done", 60)
                assert done["response"]["status"] == "cancelled", done
                at = len(c.events)
                await send_audio(c, silence(1500))
                c.events += await c.drain(2.0)
                stale = [
                    e
                    for e in c.events[at:]
                    if e["type"] == "response.output_audio.delta" and e["response_id"] == rid
                ]
                assert sum(len(e["delta"]) for e in stale) == 0  # 0 stale bytes after done
                # ... and vLLM no longer holds the old epoch's talker request(s)
                left = await talker.engine.held_request_ids()
                for _ in range(50):
                    if not set(old) & set(left):
                        break
                    await asyncio.sleep(0.05)
                    left = await talker.engine.held_request_ids()
                assert not set(old) & set(left), (old, left)
                audio = [
                    e
                    for e in c.events
                    if e["type"] == "response.output_audio.delta" and e["response_id"] == rid
                ]
                assert audio  # the turn was spoken before the barge-in
                assert codec.decoder.rows_decoded >= 2 and codec.decoder.decode_calls >= 1

        asyncio.run(run())
