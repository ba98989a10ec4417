"""Ephemeral client secrets (duplex_server/client_secrets.py, POST /v1/realtime/client_secrets):
mint with an API key, open one session with the secret (WebSocket subprotocol, WebRTC), its
session config applied; reuse, expiry, forgery and the wrong route refused."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets

from duplex_server.client_secrets import ClientSecrets, SecretRefused
from tests.server.harness import UNIT, running_server, write_config
from tests.server.webrtc_client import RtcClient

KEY = "sk-secrets-0123456789"
SESSION = {"type": "realtime", "instructions": "You are a pirate.", "output_modalities": ["text"]}


# ------------------------------------------------------------------------------- unit
def test_a_secret_opens_once_resumes_and_expires() -> None:
    secrets = ClientSecrets(b"k" * 32)
    value, expires_at = secrets.mint(SESSION, 600, now=1000.0)
    assert value.startswith("ek_") and expires_at == 1600
    assert secrets.check(value, "open", now=1001.0) == SESSION
    with pytest.raises(SecretRefused) as used:
        secrets.check(value, "open", now=1002.0)
    assert used.value.code == "client_secret_used"
    assert secrets.check(value, "resume", now=1003.0) == SESSION  # a dropped socket comes back
    late, _ = secrets.mint(SESSION, 10, now=1000.0)
    with pytest.raises(SecretRefused) as expired:
        secrets.check(late, "open", now=1010.0)
    assert expired.value.code == "client_secret_expired"
    other = ClientSecrets(b"x" * 32)  # another key: another server's secret, or a forgery
    for bad in (value, value[:-2] + "AA", "ek_", "ek_abc.def", "ek_!!.??"):
        with pytest.raises(SecretRefused) as forged:
            other.check(bad, "open", now=1001.0)
        assert forged.value.code == "invalid_client_secret"
    with pytest.raises(ValueError):
        secrets.mint(SESSION, 9, now=0.0)
    with pytest.raises(ValueError):
        secrets.mint(SESSION, 7201, now=0.0)


def test_front_ends_sharing_the_key_accept_each_other_s_secrets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What serve --workers does: one DUPLEX_CLIENT_SECRET_KEY for every front end."""
    monkeypatch.setenv("DUPLEX_CLIENT_SECRET_KEY", "shared")
    a, b = ClientSecrets.from_env(), ClientSecrets.from_env()
    value, _ = a.mint(SESSION, 60, now=0.0)
    assert b.check(value, "open", now=1.0) == SESSION
    monkeypatch.delenv("DUPLEX_CLIENT_SECRET_KEY")
    with pytest.raises(SecretRefused):
        ClientSecrets.from_env().check(value, "open", now=1.0)  # a random key


# ------------------------------------------------------------------------------- e2e
@pytest.fixture(scope="module")
def addr(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    path = write_config(tmp_path_factory.mktemp("secrets"), server={"api_keys": [KEY]})
    with running_server(path) as a:
        yield a


def mint(addr: str, body: dict[str, Any], key: str = KEY) -> httpx.Response:
    return httpx.post(
        f"http://{addr}/v1/realtime/client_secrets",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=10 * UNIT,
    )


def test_mint_answers_in_openai_s_shape(addr: str) -> None:
    resp = mint(
        addr, {"expires_after": {"anchor": "created_at", "seconds": 120}, "session": SESSION}
    )
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert set(body) == {"value", "expires_at", "session"}
    assert body["value"].startswith("ek_") and isinstance(body["expires_at"], int)
    assert body["session"]["object"] == "realtime.session"
    assert body["session"]["instructions"] == "You are a pirate."
    default = mint(addr, {}).json()
    assert 590 <= default["expires_at"] - body["expires_at"] + 120 <= 610  # 600 s by default


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"expires_after": {"seconds": 5}}, "expires_after.seconds"),
        ({"expires_after": {"seconds": 7201}}, "expires_after.seconds"),
        ({"session": {"output_modalities": ["video"]}}, "session"),
        ({"session": {"audio": {"output": {"speed": 9}}}}, "session.speed"),
        ({"sesion": {}}, "sesion"),
    ],
)
def test_mint_refuses_a_bad_request_naming_the_field(
    addr: str, body: dict[str, Any], param: str
) -> None:
    resp = mint(addr, body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param, resp.text


def test_mint_needs_an_api_key_not_a_secret(addr: str) -> None:
    assert mint(addr, {}, key="nope").status_code == 401
    secret = mint(addr, {}).json()["value"]
    resp = mint(addr, {}, key=secret)
    assert resp.status_code == 401
    assert resp.json()["error"]["code"] == "client_secret_wrong_route"
    speech = httpx.post(
        f"http://{addr}/v1/audio/speech",
        json={"model": "tts-1", "input": "Hi", "voice": "alloy"},
        headers={"Authorization": f"Bearer {secret}"},
    )
    assert speech.status_code == 401
    assert speech.json()["error"]["code"] == "client_secret_wrong_route"


async def _open(addr: str, secret: str, query: str = "") -> websockets.ClientConnection:
    return await websockets.connect(
        f"ws://{addr}/v1/realtime{query}",
        subprotocols=[websockets.Subprotocol(f"openai-insecure-api-key.{secret}")],
    )


async def _events(ws: websockets.ClientConnection, n: int) -> list[dict[str, Any]]:
    return [json.loads(await asyncio.wait_for(ws.recv(), 5 * UNIT)) for _ in range(n)]


def test_a_browser_opens_one_session_with_a_secret_and_its_config(addr: str) -> None:
    secret = mint(addr, {"session": SESSION}).json()["value"]

    async def run() -> None:
        ws = await _open(addr, secret)  # the browser's way: the key subprotocol
        created, updated = await _events(ws, 2)
        assert created["type"] == "session.created"
        assert updated["type"] == "session.updated"
        assert updated["session"]["instructions"] == "You are a pirate."
        assert updated["session"]["output_modalities"] == ["text"]
        # a second session with the same secret: refused, close 1008
        again = await _open(addr, secret)
        (error,) = await _events(again, 1)
        assert error["error"]["code"] == "client_secret_used"
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await asyncio.wait_for(again.recv(), 5 * UNIT)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008
        # the page's reconnect after a drop resumes with the same secret
        token = created["resume_token"]
        sid = created["session"]["id"]
        await ws.close(4000)  # not 1000: a drop, the session waits
        back = await _open(addr, secret, "?intent=resume")
        await back.send(
            json.dumps(
                {
                    "type": "session.resume",
                    "session_id": sid,
                    "resume_token": token,
                    "last_received_server_event_seq": updated["server_event_seq"],
                }
            )
        )
        kinds = [e["type"] for e in await _events(back, 1)]
        assert kinds == ["session.resumed"], kinds
        await back.close()

    asyncio.run(run())


def test_twilio_refuses_a_secret(addr: str) -> None:
    secret = mint(addr, {}).json()["value"]

    async def run() -> int | None:
        async with websockets.connect(
            f"ws://{addr}/v1/twilio", additional_headers={"Authorization": f"Bearer {secret}"}
        ) as ws:
            with pytest.raises(websockets.ConnectionClosed) as closed:
                while True:
                    await asyncio.wait_for(ws.recv(), 5 * UNIT)
            return closed.value.rcvd.code if closed.value.rcvd is not None else None

    assert asyncio.run(run()) == 1008


def test_a_webrtc_call_opens_with_a_secret(addr: str, tmp_path: Path) -> None:
    secret = mint(addr, {"session": SESSION}).json()["value"]

    async def run() -> None:
        client = RtcClient()
        try:
            resp = await client.connect(addr, None, headers={"Authorization": f"Bearer {secret}"})
            assert resp.status_code == 201, resp.text
            await client.until("session.created")
            updated = await client.until("session.updated")
            assert updated["session"]["instructions"] == "You are a pirate."
        finally:
            await client.close()
        again = RtcClient()
        try:
            resp = await again.connect(addr, None, headers={"Authorization": f"Bearer {secret}"})
            assert resp.status_code == 401
            assert resp.json()["error"]["code"] == "client_secret_used"
        finally:
            await again.close()

    asyncio.run(run())
