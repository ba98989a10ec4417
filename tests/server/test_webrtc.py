"""WebRTC (POST /v1/realtime/calls) against the real server on loopback, with an aiortc
client (tests/server/webrtc_client.py): SDP exchange, a WAV as the microphone (Opus),
reply audio on the track, events on the ``oai-events`` data channel, barge-in."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import numpy as np
import soundfile
import soxr

from tests.server.harness import ROOT, http_text, running_server, write_config
from tests.server.webrtc_client import RtcClient

#: 15-word replies of 160 ms a word (2.4 s), long enough to talk over
TTS = {"stages": {"tts": {"options": {"ms_per_word": 160.0}}}}
SILENT = 50.0  # RMS of a decoded Opus frame of silence stays far below this


def _wav48k(seconds: float) -> bytes:
    samples, rate = soundfile.read(ROOT / "tests/data/beckett.wav", dtype="float32")
    samples = samples[: int(rate * seconds)]
    out = soxr.resample(samples, rate, 48000) * 32767
    return np.clip(out, -32768, 32767).astype("<i2").tobytes()


def started_item(client: RtcClient, response_id: str) -> str:
    created = next(
        e
        for _, e in client.events
        if e["type"] == "response.output_item.added" and e["response_id"] == response_id
    )
    return str(created["item"]["id"])


def test_webrtc_call_turn_and_barge_in(tmp_path: Path) -> None:
    path = write_config(tmp_path, engine=TTS)

    async def run(addr: str) -> None:
        client = RtcClient()
        try:
            # the immediate rule: the test stages give no live words, so confirm (the
            # default here) would take 0.65 s of speech back (test_turn_taking_media.py)
            td = {"type": "server_vad", "interrupt_mode": "immediate"}
            session = {"type": "realtime", "instructions": "Be brief."}
            session["audio"] = {"input": {"turn_detection": td}}
            resp = await client.connect(addr, session)
            assert resp.status_code == 201, resp.text
            assert resp.headers["content-type"].startswith("application/sdp")
            assert resp.text.startswith("v=0") and "m=audio" in resp.text
            assert client.location.startswith("/v1/realtime/calls/sess_")
            # loopback only (server.webrtc_host_addresses in configs/test.yaml)
            offer = client.pc.localDescription.sdp
            for sdp in (offer, resp.text):
                cands = [x for x in sdp.splitlines() if x.startswith("a=candidate:")]
                assert cands and all(" 127.0.0.1 " in c for c in cands), cands
            created = await client.until("session.created")
            updated = await client.until("session.updated")
            assert updated["session"]["instructions"] == "Be brief."
            assert created["server_event_seq"] == 1
            # the caller's audio reaches the session at the engine's rate: no resampling
            # to the 24 kHz default and back (webrtc.WEBRTC_SESSION)
            fmt = updated["session"]["audio"]["input"]["format"]
            assert fmt == {"type": "audio/pcm", "rate": 16000}, fmt
            client.mic.say += _wav48k(1.5)  # the caller speaks: a WAV as the microphone
            await client.until("input_audio_buffer.speech_started")
            await client.until("input_audio_buffer.committed")
            started = await client.until("output_audio_buffer.started")
            t_started = client.time_of(started)
            await asyncio.sleep(1.2)
            loud = [rms for t, rms in client.frames if t > t_started and rms > 1000]
            assert len(loud) >= 20  # reply audio arrived on the track (0.4 s and more)
            assert "response.output_audio.delta" not in client.kinds()  # audio is media
            # barge-in: the caller talks over the reply
            mark = len(client.events)
            client.mic.say += _wav48k(1.0)
            cleared = await client.until("output_audio_buffer.cleared", within=5, after=mark)
            assert cleared["response_id"] == started["response_id"]
            t_cleared = client.time_of(cleared)
            nxt = await client.until("output_audio_buffer.started", within=10, after=mark)
            t_next = client.time_of(nxt)
            assert nxt["response_id"] != started["response_id"]
            # no old audio after the flush: silence from shortly after cleared to the next reply
            gap = [rms for t, rms in client.frames if t_cleared + 0.3 < t < t_next]
            assert gap and max(gap) < SILENT, max(gap)
            # the reply was generated whole (test stage) but only partly played: truncated
            trunc = await client.until("conversation.item.truncated", after=mark)
            assert trunc["item_id"] == started_item(client, started["response_id"])
            assert 1000 <= trunc["audio_end_ms"] < 2400
            await client.until("output_audio_buffer.stopped", within=10, after=mark)
            assert await client.hangup(addr) == 200
            await client.until("session.closed", within=5)
        finally:
            await client.close()
        for _ in range(100):
            if json.loads(http_text(addr, "/health"))["sessions"] == 0:
                break
            await asyncio.sleep(0.05)
        assert json.loads(http_text(addr, "/health"))["sessions"] == 0

    with running_server(path) as addr:
        asyncio.run(run(addr))


def test_webrtc_call_requests_refused_with_clear_errors(tmp_path: Path) -> None:
    path = write_config(tmp_path, server={"api_keys": ["sk-rtc"]})

    async def run(addr: str) -> None:
        url = f"http://{addr}/v1/realtime/calls"
        key = {"Authorization": "Bearer sk-rtc"}
        async with httpx.AsyncClient() as http:
            r = await http.post(url, content="v=0", headers={"Content-Type": "application/sdp"})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            r = await http.post(url, content="hello", headers={**key, "Content-Type": "text/plain"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "content-type"
            r = await http.post(
                url, content="v=0\n", headers={**key, "Content-Type": "application/sdp"}
            )
            assert r.status_code == 400 and r.json()["error"]["param"] == "sdp"
        client = RtcClient()
        try:
            r = await client.connect(addr, {"audio": {"output": {"speed": 9}}}, headers=key)
            assert r.status_code == 400 and r.json()["error"]["param"] == "speed"
        finally:
            await client.close()
        client = RtcClient()  # plain application/sdp body, no session
        try:
            r = await client.connect(addr, plain=True, headers=key)
            assert r.status_code == 201
            await client.until("session.created")
            client.send({"type": "conversation.item.create", "item": {"type": "bogus"}})
            error = await client.until("error")
            assert error["error"]["type"] == "invalid_request_error"
        finally:
            await client.close()
        async with httpx.AsyncClient() as http:  # /metrics needs the key too (keyed default)
            assert (await http.get(f"http://{addr}/metrics")).status_code == 401
            body = (await http.get(f"http://{addr}/metrics", headers=key)).text
        assert 'duplex_connection_outcomes_total{outcome="webrtc_opened"} 1.0' in body

    with running_server(path) as addr:
        asyncio.run(run(addr))
