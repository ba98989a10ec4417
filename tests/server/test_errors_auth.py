"""Each wire error code, close codes, and auth on and off, against the real server."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import websockets

from tests.server.harness import Client, running_server, text_item, write_config

KEY = "sk-test-0123456789"


@pytest.fixture(scope="module")
def small_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    path = write_config(
        tmp_path_factory.mktemp("small"),
        server={"max_frame_bytes": 65536, "input_backlog_bytes": 65536},
        engine={"duplex": {"max_input_bytes": 200_000}},
    )
    with running_server(path) as addr:
        yield addr


CASES: list[tuple[Any, str]] = [
    ("{oops", "invalid_json"),
    ({"type": "no.such.event", "event_id": "e1"}, "unknown_event"),
    ({"type": "response.cancel", "extra": True}, "invalid_event"),
    ({"type": "input_audio_buffer.append", "audio": "!!!"}, "invalid_audio"),
    (
        {
            "type": "session.update",
            "session": {"audio": {"input": {"format": {"type": "audio/pcm", "rate": 8000}}}},
        },
        "invalid_value",
    ),
    ({"type": "conversation.item.create", "item": {"type": "item_reference"}}, "unsupported"),
    ({"type": "conversation.item.delete", "item_id": "x"}, "item_not_found"),
    ({"type": "conversation.item.retrieve", "item_id": "x"}, "item_not_found"),
    ({"type": "response.cancel"}, "response_cancel_not_active"),
    ({"type": "input_audio_buffer.commit"}, "input_audio_buffer_commit_empty"),
    ({"type": "session.resume", "session_id": "s", "resume_token": "t"}, "invalid_state"),
]


def test_each_recoverable_error_code(small_server: str) -> None:
    async def run() -> None:
        async with Client.connect(small_server) as c:
            await c.until("session.created")
            for i, (frame, code) in enumerate(CASES):
                if isinstance(frame, dict):
                    frame = {**frame, "event_id": f"evt{i}"}
                await c.ws.send(frame if isinstance(frame, str) else json.dumps(frame))
                err = await c.until("error")
                assert err["error"]["code"] == code, frame
                if isinstance(frame, dict):
                    assert err["error"]["event_id"] == f"evt{i}"
            # two responses at once
            await c.send({"type": "session.update", "session": {"output_modalities": ["text"]}})
            await c.send(text_item("hi"))
            await c.send({"type": "response.create"})
            await c.send({"type": "response.create"})
            err = await c.until("error")
            assert err["error"]["code"] == "conversation_already_has_active_response"
            await c.until("response.done")
            # the session survived every error
            await c.send({"type": "session.heartbeat"})
            await c.until("session.heartbeat_ack")

    asyncio.run(run())


def test_input_backpressure(small_server: str) -> None:
    async def run() -> None:
        async with Client.connect(small_server) as c:
            await c.until("session.created")
            await c.send({"type": "session.update", "session": {"turn_detection": None}})
            chunk = base64.b64encode(b"\x01\x00" * 12000).decode()  # 24 KB, 0.5 s
            for _ in range(30):  # 15 s of audio: over the engine's 200 kB input cap
                await c.send({"type": "input_audio_buffer.append", "audio": chunk})
            err = await c.until("error")
            assert err["error"]["code"] == "input_backpressure"
            assert err["error"]["type"] == "rate_limit_error"

    asyncio.run(run())


def test_oversize_frame_closes_1009(small_server: str) -> None:
    async def run() -> None:
        async with Client.connect(small_server) as c:
            await c.until("session.created")
            await c.ws.send(b"\x00" * 70000)
            err = await c.until("error")
            assert err["error"]["code"] == "frame_too_large"
            assert await c.closed() == 1009

    asyncio.run(run())


def test_resume_of_unknown_session(small_server: str) -> None:
    async def run() -> None:
        async with Client.connect(small_server, "?intent=resume") as c:
            await c.send({"type": "session.resume", "session_id": "sess_x", "resume_token": "t"})
            err = await c.until("error")
            assert err["error"]["code"] == "session_not_found"
            assert await c.closed() == 1008

    asyncio.run(run())


def test_auth_on(tmp_path: Path) -> None:
    path = write_config(tmp_path, server={"api_keys": [KEY], "allowed_origins": ["http://ok"]})
    with running_server(path) as addr:

        async def run() -> None:
            async with Client.connect(addr) as c:  # no key
                err = await c.until("error")
                assert err["error"]["code"] == "unauthorized"
                assert await c.closed() == 1008
            headers = {"Authorization": f"Bearer {KEY}"}
            async with Client.connect(addr, additional_headers=headers) as c:
                await c.until("session.created")
            protocols = ["realtime", f"openai-insecure-api-key.{KEY}"]
            async with Client.connect(addr, subprotocols=protocols) as c:  # type: ignore[arg-type]
                assert c.ws.subprotocol == "realtime"
                await c.until("session.created")
            async with Client.connect(
                addr, additional_headers={**headers, "Origin": "http://evil"}
            ) as c:
                err = await c.until("error")
                assert err["error"]["code"] == "origin_not_allowed"
                assert await c.closed() == 1008
            bad = {"Authorization": "Bearer wrong"}
            async with Client.connect(addr, additional_headers=bad) as c:
                assert (await c.until("error"))["error"]["code"] == "unauthorized"

        asyncio.run(run())


def test_auth_off_accepts_anyone_and_echoes_realtime(small_server: str) -> None:
    async def run() -> None:
        async with websockets.connect(
            f"ws://{small_server}/v1/duplex",
            subprotocols=["realtime"],  # type: ignore[list-item]
        ) as ws:
            assert ws.subprotocol == "realtime"
            assert json.loads(await ws.recv())["type"] == "session.created"

    asyncio.run(run())


def test_a_session_on_simulated_stages_is_told_it_hears_silence(tmp_path: Path) -> None:
    """configs/sim-h200.yaml's stages only take a GPU's time: the session says so at once."""
    sim = {"stages": {"asr": {"backend": "sim", "options": {"role": "asr"}}}}
    with running_server(write_config(tmp_path, engine=sim)) as addr:

        async def run() -> dict[str, Any]:
            async with Client.connect(addr) as c:
                await c.until("session.created")
                return await c.recv()

        event = asyncio.run(run())
    assert event["type"] == "error"
    assert event["error"]["code"] == "simulated_stages"
    assert "asr" in event["error"]["message"] and "silent" in event["error"]["message"]
