"""Errors a newcomer meets say what is allowed: enum values listed, odd audio frames answered,
``engine_unavailable`` typed as the server's fault on both the socket and HTTP, the CLI's
auth failure in one line (real server on loopback, test stages)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from duplex_client import cli
from starlette.testclient import TestClient

from duplex_server.app import create_app
from duplex_server.config import load_app_config
from tests.server.harness import UNIT, Client, running_server, write_config


def test_an_unknown_input_format_names_the_allowed_values(server: str) -> None:
    async def run() -> None:
        async with Client.connect(server) as c:
            await c.until("session.created")
            fmt = {"type": "audio/opus", "rate": 48000}
            await c.send(
                {"type": "session.update", "session": {"audio": {"input": {"format": fmt}}}}
            )
            err = (await c.until("error"))["error"]
            assert err["code"] == "invalid_event"
            assert err["param"] == "session.audio.input.format.type"
            assert err["message"] == (
                "Invalid enum value 'audio/opus' (allowed: 'audio/pcm', 'audio/pcma', 'audio/pcmu')"
            )
            await c.send({"type": "session.update", "session": {"input_audio_format": "opus"}})
            err = (await c.until("error"))["error"]
            assert err["message"] == (
                "Invalid enum value 'opus' "
                "(allowed: 'g711_alaw', 'g711_ulaw', 'pcm16', 'pcm16_16k')"
            )

    asyncio.run(run())


def test_an_http_enum_error_names_the_allowed_values(server: str) -> None:
    body = {"model": "m", "input": "Hi.", "voice": "alloy", "response_format": "aac"}
    resp = httpx.post(f"http://{server}/v1/audio/speech", json=body, timeout=10 * UNIT)
    assert resp.status_code == 400
    assert resp.json()["error"]["message"] == (
        "response_format: Invalid enum value 'aac' (allowed: 'flac', 'mp3', 'opus', 'pcm', 'wav')"
    )


def test_an_odd_length_audio_frame_is_answered_not_dropped_silently(server: str) -> None:
    async def run() -> None:
        async with Client.connect(server) as c:
            await c.until("session.created")
            await c.ws.send(b"\x00\x01\x02")
            err = (await c.until("error"))["error"]
            assert err == {
                "type": "invalid_request_error",
                "code": "invalid_audio_frame",
                "message": "a binary audio frame of 3 bytes is not a whole number of samples: "
                "the input format audio/pcm (24000 Hz) has 2-byte samples; the frame was dropped",
                "param": None,
                "event_id": None,
            }
            await c.ws.send(b"\x00\x00" * 480)  # whole samples: accepted, nothing said
            assert [e for e in await c.drain(0.3 * UNIT) if e["type"] == "error"] == []
            # G.711 has 1-byte samples: any length is whole
            fmt = {"type": "audio/pcmu"}
            await c.send(
                {"type": "session.update", "session": {"audio": {"input": {"format": fmt}}}}
            )
            await c.until("session.updated")
            await c.ws.send(b"\xff" * 161)
            assert [e for e in await c.drain(0.3 * UNIT) if e["type"] == "error"] == []
            await c.send({"type": "session.heartbeat"})
            await c.until("session.heartbeat_ack")  # the session goes on

    asyncio.run(run())


def test_engine_unavailable_is_a_server_error_on_the_socket_and_over_http(
    tmp_path: Path,
) -> None:
    # no lifespan: the engine never starts, as while the models load
    app = create_app(load_app_config(write_config(tmp_path)))
    client = TestClient(app)
    with client.websocket_connect("/v1/realtime") as ws:
        socket_error = ws.receive_json()["error"]
    http_error = client.post(
        "/v1/audio/speech", json={"model": "m", "input": "Hi.", "voice": "alloy"}
    ).json()["error"]
    assert socket_error["code"] == http_error["code"] == "engine_unavailable"
    assert socket_error["type"] == http_error["type"] == "server_error"


def test_the_cli_says_in_one_line_that_the_key_was_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with running_server(write_config(tmp_path, server={"api_keys": ["sk-right"]})) as addr:
        url = f"ws://{addr}/v1/realtime"
        status = cli.main(["chat", "hi", "--url", url, "--api-key", "sk-wrong"])
        assert status == 1
        assert capsys.readouterr().err == (
            "duplex-client: the server refused the session: missing or invalid API key "
            "(unauthorized) (pass --api-key KEY or set DUPLEX_API_KEY)\n"
        )
        status = cli.main(["say", "hi", "--url", url, "--out", str(tmp_path / "o.wav")])
        assert status == 1
        err = capsys.readouterr().err
        assert err.startswith("duplex-client: HTTP 401: Missing or invalid API key"), err
        assert err.endswith("(invalid_api_key)\n"), err
