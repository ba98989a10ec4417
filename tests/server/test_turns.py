"""Text and audio turns against the real server (test stage) over a real socket."""

from __future__ import annotations

import asyncio
import base64

from tests.server.harness import (
    Client,
    http_status,
    http_text,
    send_audio,
    silence,
    text_item,
    tone,
)


def test_health_and_metrics(server: str) -> None:
    assert http_status(server, "/health") == 200
    body = http_text(server, "/metrics")
    for name in (
        "duplex_time_to_first_audio_seconds",
        "duplex_bargein_stop_seconds",
        "duplex_chunk_overhead_seconds",
        "duplex_engine_sessions",
        "duplex_admissions",
    ):
        assert name in body


def test_text_turn(server: str) -> None:
    async def run() -> None:
        async with Client.connect(server) as c:
            created = await c.recv()
            assert created["type"] == "session.created"
            assert created["session"]["id"].startswith("sess_")
            assert created["capabilities"]["supports_barge_in"] is True
            assert len(created["resume_token"]) >= 43
            await c.send({"type": "session.update", "session": {"output_modalities": ["text"]}})
            updated = await c.until("session.updated")
            assert updated["session"]["output_modalities"] == ["text"]
            await c.send(text_item("hello"))
            await c.send({"type": "response.create"})
            done = await c.until("response.done")
            assert done["response"]["status"] == "completed"
            deltas = "".join(
                e["delta"] for e in c.events if e["type"] == "response.output_text.delta"
            )
            assert deltas.startswith("Hello there.")
            assert done["response"]["output"][0]["content"][0]["text"] == deltas
            seqs = [e["server_event_seq"] for e in c.events]
            assert seqs == list(range(1, len(seqs) + 1))
            assert len({e["event_id"] for e in c.events}) == len(c.events)

    asyncio.run(run())


def test_audio_turn_with_server_vad(server: str) -> None:
    async def run() -> None:
        async with Client.connect(server) as c:
            await c.until("session.created")
            await send_audio(c, silence(300) + tone(600) + silence(900))
            started = await c.until("input_audio_buffer.speech_started")
            stopped = await c.until("input_audio_buffer.speech_stopped")
            assert stopped["item_id"] == started["item_id"]
            assert 0 <= started["audio_start_ms"] <= 300
            assert 800 <= stopped["audio_end_ms"] <= 1000
            committed = await c.until("input_audio_buffer.committed")
            assert committed["item_id"] == started["item_id"]
            done = await c.until("response.done", within=10)
            assert done["response"]["status"] == "completed"
            kinds = [e["type"] for e in c.events]
            transcript_at = kinds.index("conversation.item.input_audio_transcription.completed")
            assert transcript_at < kinds.index("response.created")
            audio = [e for e in c.events if e["type"] == "response.output_audio.delta"]
            marks = [e for e in c.events if e["type"] == "response.output_audio_transcript.delta"]
            assert audio and len(audio) == len(marks)
            total = sum(len(base64.b64decode(e["delta"])) for e in audio) / 48.0  # 24 kHz PCM16
            assert abs(total - done["response"]["audio_ms"]) < 1.0
            starts = [e["audio_start_ms"] for e in audio]
            assert starts == sorted(starts) and all(e["epoch"] == 0 for e in audio)

    asyncio.run(run())


def test_manual_commit_and_g711_input(server: str) -> None:
    async def run() -> None:
        async with Client.connect(server) as c:
            await c.until("session.created")
            await c.send(
                {
                    "type": "session.update",
                    "session": {"input_audio_format": "g711_ulaw", "turn_detection": None},
                }
            )
            upd = await c.until("session.updated")
            assert upd["session"]["audio"]["input"]["turn_detection"] is None
            assert upd["session"]["audio"]["input"]["format"] == {
                "type": "audio/pcmu",
                "rate": 8000,
            }
            await c.ws.send(b"\xff" * 8000)  # a binary frame: 1 s of G.711 silence
            await asyncio.sleep(0.2)
            await c.send({"type": "input_audio_buffer.commit"})
            await c.until("input_audio_buffer.committed")
            await c.send({"type": "response.create"})
            done = await c.until("response.done", within=10)
            assert done["response"]["status"] in ("completed", "incomplete")
            assert any(
                e["type"] == "conversation.item.input_audio_transcription.completed"
                for e in c.events
            )

    asyncio.run(run())
