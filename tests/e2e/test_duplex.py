"""Duplex behaviour end to end: barge-in, disconnect + resume, takeover, leases, capacity."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server.harness import (
    REALTIME_TTS,
    Client,
    running_server,
    send_audio,
    silence,
    text_item,
    tone,
    write_config,
)


@pytest.fixture(scope="module")
def rt_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Responses spoken in real time (so they can be interrupted) and a short lease grace."""
    path = write_config(
        tmp_path_factory.mktemp("rt"),
        engine={**REALTIME_TTS, "duplex": {"disconnect_grace_s": 0.5, "reaper_interval_s": 0.1}},
    )
    with running_server(path) as addr:
        yield addr


async def _start_long_response(c: Client) -> dict[str, object]:
    await c.until("session.created")
    await c.send(text_item("talk to me"))
    await c.send({"type": "response.create"})
    await c.until("response.output_audio.delta")
    return await c.until("response.output_audio.delta")


def _no_audio_after_done(events: list[dict[str, object]], response_id: object) -> None:
    done_at = next(
        i
        for i, e in enumerate(events)
        if e["type"] == "response.done" and e["response"]["id"] == response_id  # type: ignore[index]
    )
    late = [
        e
        for e in events[done_at:]
        if e["type"] == "response.output_audio.delta" and e["response_id"] == response_id
    ]
    assert late == []


def test_barge_in_by_voice_stops_audio_at_once(rt_server: str) -> None:
    async def run() -> None:
        async with Client.connect(rt_server) as c:
            delta = await _start_long_response(c)
            await send_audio(c, tone(400))  # the user starts talking over the assistant
            done = await c.until("response.done")
            assert done["response"]["status"] == "cancelled"
            assert done["response"]["status_details"]["reason"] == "turn_detected"
            cleared = await c.until("output_audio_buffer.cleared")
            assert cleared["response_id"] == delta["response_id"]
            await send_audio(c, silence(800))
            c.events += await c.drain(1.0)
            _no_audio_after_done(c.events, delta["response_id"])
            # the interruption became the next user turn, answered in a new epoch
            later = [e for e in c.events if e["type"] == "response.output_audio.delta"]
            assert any(e["epoch"] == 1 for e in later)

    asyncio.run(run())


@pytest.mark.parametrize("trigger", ["response.cancel", "output_audio_buffer.clear", "barge_in"])
def test_client_cancel_variants(rt_server: str, trigger: str) -> None:
    async def run() -> None:
        async with Client.connect(rt_server) as c:
            delta = await _start_long_response(c)
            await c.send({"type": trigger})
            done = await c.until("response.done")
            assert done["response"]["status"] == "cancelled"
            c.events += await c.drain(0.5)
            _no_audio_after_done(c.events, delta["response_id"])
            # the session goes on: a new response in the new epoch
            await c.send({"type": "response.create"})
            nxt = await c.until("response.output_audio.delta")
            assert nxt["epoch"] == 1

    asyncio.run(run())


def test_disconnect_mid_response_then_resume_loses_nothing(rt_server: str) -> None:
    async def run() -> None:
        async with Client.connect(rt_server) as a:
            created = await a.until("session.created")
            await a.send(text_item("talk"))
            await a.send({"type": "response.create"})
            for _ in range(3):
                await a.until("response.output_audio.delta")
            a.ws.transport.abort()  # abrupt: no close handshake
        first = a.events
        last_seq = first[-1]["server_event_seq"]
        await asyncio.sleep(0.2)
        async with Client.connect(rt_server, "?intent=resume") as b:
            await b.send(
                {
                    "type": "session.resume",
                    "session_id": created["session"]["id"],
                    "resume_token": created["resume_token"],
                    "last_received_server_event_seq": last_seq,
                }
            )
            await b.until("response.done", within=10)
            resumed = next(e for e in b.events if e["type"] == "session.resumed")
            assert resumed["resume_token"] != created["resume_token"]
            everything = first + b.events
            seqs = [e["server_event_seq"] for e in everything]
            assert seqs == list(range(1, len(seqs) + 1))  # zero lost, zero duplicated
            ids = [e["event_id"] for e in everything]
            assert len(set(ids)) == len(ids)
            audio = [e for e in everything if e["type"] == "response.output_audio.delta"]
            done = everything[-1]
            assert done["response"]["status"] == "completed"
            assert abs(sum(e["duration_ms"] for e in audio) - done["response"]["audio_ms"]) < 1
            # the old token is spent (asked while b is open: b's clean close ends the session)
            async with Client.connect(rt_server, "?intent=resume") as c:
                await c.send(
                    {
                        "type": "session.resume",
                        "session_id": created["session"]["id"],
                        "resume_token": created["resume_token"],
                    }
                )
                err = await c.until("error")
                assert err["error"]["code"] == "invalid_resume_token"
                assert await c.closed() == 1008

    asyncio.run(run())


def test_takeover_replaces_the_old_socket(rt_server: str) -> None:
    async def run() -> None:
        async with Client.connect(rt_server) as a:
            created = await a.until("session.created")
            async with Client.connect(rt_server, "?intent=resume") as b:
                await b.send(
                    {
                        "type": "session.resume",
                        "session_id": created["session"]["id"],
                        "resume_token": created["resume_token"],
                        "last_received_server_event_seq": created["server_event_seq"],
                    }
                )
                replaced = await a.until("session.replaced")
                assert replaced["type"] == "session.replaced"
                assert await a.closed() == 1000
                resumed = await b.until("session.resumed")
                assert resumed["replayed"] == 0
                await b.send({"type": "session.heartbeat"})
                await b.until("session.heartbeat_ack")

    asyncio.run(run())


def test_resume_with_unknown_seq_needs_resync(rt_server: str) -> None:
    async def run() -> None:
        async with Client.connect(rt_server) as a:
            created = await a.until("session.created")
            async with Client.connect(rt_server, "?intent=resume") as b:
                await b.send(
                    {
                        "type": "session.resume",
                        "session_id": created["session"]["id"],
                        "resume_token": created["resume_token"],
                        "last_received_server_event_seq": 999,
                    }
                )
                resync = await b.until("session.resync_required")
                assert resync["last_seq"] >= 1
                await b.until("session.resumed")

    asyncio.run(run())


def test_capacity_refusal_and_lease_expiry_frees_the_slot(tmp_path: Path) -> None:
    path = write_config(
        tmp_path,
        engine={
            "duplex": {
                "max_sessions": 1,
                "disconnect_grace_s": 0.3,
                "reaper_interval_s": 0.05,
                "expiring_warning_s": 0.0,
            }
        },
    )
    with running_server(path) as addr:

        async def run() -> None:
            async with Client.connect(addr) as a:
                await a.until("session.created")
                async with Client.connect(addr) as b:
                    err = await b.until("error")
                    assert err["error"]["code"] == "resource_exhausted"
                    assert await b.closed() == 1013
            # a's socket is gone: the session is detached, then expires after the grace
            await asyncio.sleep(1.0)
            async with Client.connect(addr) as c:
                created = await c.until("session.created")
                assert created["session"]["id"].startswith("sess_")

        asyncio.run(run())


def test_idle_lease_expiry_warns_then_closes(tmp_path: Path) -> None:
    path = write_config(
        tmp_path,
        engine={
            "duplex": {"idle_ttl_s": 0.6, "expiring_warning_s": 0.4, "reaper_interval_s": 0.05}
        },
    )
    with running_server(path) as addr:

        async def run() -> None:
            async with Client.connect(addr) as a:
                await a.until("session.created")
                expiring = await a.until("session.expiring")
                assert 0 < expiring["in_s"] <= 0.4
                expired = await a.until("session.expired")
                assert expired["reason"]
                await a.until("session.closed")
                assert await a.closed() == 1000

        asyncio.run(run())


def test_resume_handshake_refuses_a_binary_first_frame(rt_server: str) -> None:
    async def run() -> None:
        async with Client.connect(rt_server, "?intent=resume") as b:
            await b.ws.send(b"\x00\x01")
            err = await b.until("error")
            assert err["error"]["code"] == "invalid_state"
            assert await b.closed() == 1008

    asyncio.run(run())


def test_a_pause_inside_a_sentence_gives_one_answer(tmp_path: Path) -> None:
    """Speech, a pause long enough to commit, more speech while the first turn is still being
    transcribed: the pending response is dropped, both halves are heard, one answer follows."""
    engine = {
        "stages": {
            "asr": {
                "backend": "test",
                "options": {"transcript": "half of a question", "asr_delay_s": 1.0},
            }
        }
    }
    with running_server(write_config(tmp_path, engine=engine)) as addr:

        async def run() -> None:
            async with Client.connect(addr) as c:
                await c.until("session.created")
                await send_audio(c, silence(200) + tone(500) + silence(700))
                await c.until("input_audio_buffer.committed")
                await send_audio(c, tone(500) + silence(900))
                done = await c.until("response.done", within=10)
                assert done["response"]["status"] == "completed"
                await asyncio.sleep(0.3)
                kinds = [e["type"] for e in c.events]
                assert kinds.count("input_audio_buffer.committed") == 2
                assert kinds.count("conversation.item.input_audio_transcription.completed") == 2
                assert kinds.count("response.created") == 1
                assert kinds.count("response.done") == 1

        asyncio.run(run())
