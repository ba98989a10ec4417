"""Text and audio turns against the real server (test stage) over a real socket."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

from tests.server.harness import (
    Client,
    b64,
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


async def _speak(c: Client, pcm: bytes, chunk_ms: float = 20.0) -> None:
    """Stream ``pcm`` (24 kHz PCM16) in real time, as a microphone does."""
    step = int(24000 * chunk_ms / 1000) * 2
    loop = asyncio.get_running_loop()
    t = loop.time()
    for i in range(0, len(pcm), step):
        await c.send({"type": "input_audio_buffer.append", "audio": b64(pcm[i : i + step])})
        t += chunk_ms / 1000
        await asyncio.sleep(max(0.0, t - loop.time()))


def _speculative(server: str, family: str = "responses") -> dict[str, float]:
    """``duplex_speculative_{family}_total`` by outcome (responses or transcripts)."""
    body = http_text(server, "/metrics")
    return {
        line.split('outcome="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
        for line in body.splitlines()
        if line.startswith(f"duplex_speculative_{family}_total{{")
    }


def _one_whole_answer(c: Client) -> dict[str, Any]:
    """The turn got exactly one response, and its audio deltas are that response's whole
    audio: in order, no gap, nothing twice, nothing of another response."""
    created = [e for e in c.events if e["type"] == "response.created"]
    done = [e for e in c.events if e["type"] == "response.done"]
    assert len(created) == len(done) == 1
    rid = done[0]["response"]["id"]
    audio = [e for e in c.events if e["type"] == "response.output_audio.delta"]
    assert audio and all(e["response_id"] == rid for e in audio)
    total = sum(len(base64.b64decode(e["delta"])) for e in audio) / 48.0
    assert abs(total - done[0]["response"]["audio_ms"]) < 1.0
    starts = [e["audio_start_ms"] for e in audio]
    assert starts[0] == 0 and starts == sorted(set(starts))
    return done[0]


def test_a_pause_is_answered_ahead_and_released_at_the_commit(server: str) -> None:
    """The speculative response (docs/protocol.md §5.3) answers the pause; the commit
    releases it: one whole answer, and the timeline says it was speculative."""

    async def run() -> None:
        before = _speculative(server)
        async with Client.connect(server) as c:
            await c.until("session.created")
            await _speak(c, silence(200) + tone(600) + silence(900))
            done = await c.until("response.done", within=10)
            assert done["response"]["status"] == "completed"
            _one_whole_answer(c)
            segments = done["response"]["timing"]["segments_ms"]
            assert "speculative_lead" in segments
            assert {"draft_asr", "draft_llm", "draft_tts"} <= set(segments)  # the draft's parts
        after = _speculative(server)
        assert after["used"] == before.get("used", 0) + 1

    asyncio.run(run())


def test_speech_after_a_pause_drops_the_speculative_answer_unsent(server: str) -> None:
    async def run() -> None:
        before = _speculative(server)
        heard_before = _speculative(server, "transcripts")
        async with Client.connect(server) as c:
            await c.until("session.created")
            # a pause long enough for the answer to be drafted, then the user goes on
            await _speak(c, silence(200) + tone(600) + silence(350) + tone(500) + silence(900))
            done = await c.until("response.done", within=10)
            assert done["response"]["status"] == "completed"
            _one_whole_answer(c)  # none of the dropped answer's audio came out
            stops = [e for e in c.events if e["type"] == "input_audio_buffer.speech_stopped"]
            assert len(stops) == 1  # one turn: the pause did not end it
        after = _speculative(server)
        # the first pause's answer was dropped when speech resumed; the final pause's one
        # answered the turn
        assert after["started"] == before.get("started", 0) + 2
        assert after["dropped"] == before.get("dropped", 0) + 1
        assert after["used"] == before.get("used", 0) + 1
        heard = _speculative(server, "transcripts")  # one guess per pause, the last one used
        assert heard["started"] == heard_before.get("started", 0) + 2
        assert heard["used"] == heard_before.get("used", 0) + 1
        assert heard["skipped"] == heard_before.get("skipped", 0)  # nothing else ran

    asyncio.run(run())
