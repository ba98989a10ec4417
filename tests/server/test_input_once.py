"""Input exactly once (docs/protocol.md): a client that re-sends input after a cut (it
cannot know what the dead socket delivered) does not duplicate it, when the input carries
``input_seq``; the SDK numbers its input and re-sends only what the server lacks. A plain
client (no ``input_seq``) behaves as before. The test stage's ASR transcribes "user audio of
N milliseconds", so the transcript shows how much input the engine got."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from duplex_client import DuplexClient
from duplex_client import events as ev

from tests.client.proxy import CuttingProxy
from tests.server.harness import UNIT, Client, b64, running_server, tone, write_config

CHUNK_MS = 20
TRANSCRIPT = "conversation.item.input_audio_transcription.completed"
#: the resampler (24 -> 16 kHz) still holds a few ms when a commit comes
TAIL_MS = 20


def _ms(transcript: str) -> int:
    """The test ASR's "user audio of N milliseconds"."""
    prefix, suffix = "user audio of ", " milliseconds"
    assert transcript.startswith(prefix) and transcript.endswith(suffix), transcript
    return int(transcript[len(prefix) : -len(suffix)])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    asr = {"stages": {"asr": {"options": {"transcript": None}}}}  # "user audio of N ms"
    with running_server(write_config(tmp_path_factory.mktemp("once"), engine=asr)) as addr:
        yield addr


def _appends(pcm: bytes, first_seq: int | None) -> list[dict[str, Any]]:
    step = 24000 * CHUNK_MS // 1000 * 2
    out = []
    for n, i in enumerate(range(0, len(pcm), step)):
        event: dict[str, Any] = {
            "type": "input_audio_buffer.append",
            "audio": b64(pcm[i : i + step]),
        }
        if first_seq is not None:
            event["input_seq"] = first_seq + n
        out.append(event)
    return out


async def _cut_and_resend(addr: str, numbered: bool) -> tuple[dict[str, Any], str]:
    """1000 ms sent, the socket cut, resumed, the last 500 ms sent again, then 200 ms new."""
    first = _appends(tone(1000), 1 if numbered else None)  # 50 events
    async with Client.connect(addr) as a:
        created = await a.until("session.created")
        await a.send({"type": "session.update", "session": {"turn_detection": None}})
        await a.until("session.updated")
        for event in first:
            await a.send(event)
        await a.send({"type": "session.heartbeat"})
        await a.until("session.heartbeat_ack")  # every append before it was read
        a.ws.transport.abort()
    async with Client.connect(addr, "?intent=resume") as b:
        await b.send(
            {
                "type": "session.resume",
                "session_id": created["session"]["id"],
                "resume_token": created["resume_token"],
                "last_received_server_event_seq": a.events[-1]["server_event_seq"],
            }
        )
        resumed = await b.until("session.resumed")
        for event in first[25:]:  # the last 500 ms again
            await b.send(event)
        for event in _appends(tone(200), 51 if numbered else None):
            await b.send(event)
        await asyncio.sleep(1.5 * UNIT)  # the input lane has processed it (a commit does not wait)
        await b.send({"type": "input_audio_buffer.commit"})
        transcript = await b.until(TRANSCRIPT, within=10)
        await b.send({"type": "session.close"})
        return resumed, transcript["transcript"]


def test_resent_input_with_input_seq_arrives_once(server: str) -> None:
    resumed, text = asyncio.run(_cut_and_resend(server, numbered=True))
    assert resumed["last_input_seq"] == 50
    assert 1200 - TAIL_MS <= _ms(text) <= 1200  # 1700 if the re-sent 500 ms counted


def test_a_plain_client_without_input_seq_behaves_as_before(server: str) -> None:
    resumed, text = asyncio.run(_cut_and_resend(server, numbered=False))
    assert resumed["last_input_seq"] == 50  # implicit numbers: the server still counts
    assert 1700 - TAIL_MS <= _ms(text) <= 1700  # its re-send is new input to it


def test_text_item_resent_with_its_input_seq_is_created_once(server: str) -> None:
    async def run() -> None:
        async with Client.connect(server) as c:
            await c.until("session.created")
            item = {
                "type": "conversation.item.create",
                "input_seq": 1,
                "item": {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "hello"}],
                },
            }
            await c.send(item)
            await c.send(item)
            await c.send({"type": "session.heartbeat"})
            got = await c.drain(0.5)
            kinds = [e["type"] for e in got]
            assert kinds.count("conversation.item.added") == 1, kinds
            assert not [e for e in got if e["type"] == "error"]

    asyncio.run(run())


def test_sdk_cut_mid_stream_resends_what_the_server_lacks_once(server: str) -> None:
    async def run() -> None:
        proxy = CuttingProxy(server)
        addr = await proxy.start()
        client = await DuplexClient.connect(f"ws://{addr}/v1/realtime", resume_backoff_s=0.05)
        try:
            await client.update_session({"turn_detection": None})
            sender = asyncio.create_task(
                client.send_audio(tone(2000), realtime=True, chunk_ms=CHUNK_MS)
            )
            await asyncio.sleep(0.8)
            proxy.cut()  # frames in flight die with the socket
            await sender
            await asyncio.sleep(1.5 * UNIT)
            await client.commit()
            heard = 0
            async for event in client.events():
                if isinstance(event, ev.InputTranscriptCompleted):
                    heard = _ms(event.transcript)
                    break
            assert client.resumes == 1
            assert client.inputs.last == 100  # 100 frames of 20 ms
            # every frame once (a lost 20 ms frame or a duplicate would show)
            assert 2000 - TAIL_MS <= heard <= 2000
        finally:
            await client.close()
            await proxy.close()

    asyncio.run(run())
