"""``X-Twilio-Signature`` on the ``/v1/twilio`` upgrade, against the real server with the
Twilio peer of tests/server/twilio_sim.py: signatures computed as Twilio documents them are
accepted, forged and missing ones refused with a clear close reason, and the API-key
parameter is a fallback that can be switched off (docs/protocol.md §12.2)."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import re
from pathlib import Path

import pytest

from duplex_server.config import TwilioConfig
from duplex_server.transports.twilio_signature import candidate_urls, port_variants
from tests.server.harness import UNIT, http_text, running_server, write_config
from tests.server.test_twilio import SHORT_TTS
from tests.server.twilio_sim import TwilioSim, tone8k

TOKEN = "12345678901234567890123456789012"  # a Twilio auth token is 32 hex digits


def twilio_signature(auth_token: str, url: str, post: dict[str, str] | None = None) -> str:
    """Twilio's documented algorithm, written out here: take the full URL of the request,
    append each POST parameter's name then value, sorted by name (none for the WebSocket
    upgrade, a GET), sign the string with HMAC-SHA1 keyed by the auth token, base64."""
    data = url
    for name in sorted(post or {}):
        data += name + (post or {})[name]
    mac = hmac.new(auth_token.encode("utf-8"), data.encode("utf-8"), hashlib.sha1)
    return base64.b64encode(mac.digest()).decode("ascii")


def signed(url: str, token: str = TOKEN) -> dict[str, str]:
    return {"X-Twilio-Signature": twilio_signature(token, url)}


async def answered(sim: TwilioSim) -> None:
    """The call is up: the caller speaks and the reply's media arrives."""
    sim.speak(tone8k(500))
    await sim.wait(lambda: sim.media_in > 0, within=10)


async def refused(sim: TwilioSim) -> tuple[int | None, str | None]:
    await asyncio.wait_for(sim.closed.wait(), 5 * UNIT)
    assert sim.media_in == 0
    return sim.ws.close_code, sim.ws.close_reason


def test_signed_upgrades_are_accepted_and_forged_or_missing_refused(tmp_path: Path) -> None:
    server = {"twilio": {"auth_token": TOKEN}}
    path = write_config(tmp_path, engine=SHORT_TTS, server=server)

    async def run(addr: str) -> None:
        url = f"wss://{addr}/v1/twilio"  # what the TwiML names; TLS ends in front of us
        async with TwilioSim.call(addr, headers=signed(url)) as sim:
            await answered(sim)
        forgeries = [
            signed(url, token="0" * 32),  # another account's token
            signed(f"wss://{addr}/v1/other"),  # signed for another URL
            {"X-Twilio-Signature": "not base64 at all"},
        ]
        for headers in forgeries:
            async with TwilioSim.call(addr, headers=headers) as sim:
                assert await refused(sim) == (1008, "twilio_signature_invalid")
        # no signature and no API keys to fall back on
        async with TwilioSim.call(addr, {"api_key": "anything"}) as sim:
            assert await refused(sim) == (1008, "twilio_signature_missing")

    with running_server(path) as addr:
        asyncio.run(run(addr))
        body = http_text(addr, "/metrics")
    assert re.search(r'outcome="twilio_signature_invalid"} 3\.0', body)
    assert re.search(r'outcome="twilio_signature_missing"} 1\.0', body)
    assert re.search(r'outcome="twilio_opened"} 1\.0', body)


def test_public_url_and_default_port_variants(tmp_path: Path) -> None:
    public = "wss://voice.example.com/v1/twilio"
    server = {"twilio": {"auth_token": TOKEN, "public_url": public}}
    path = write_config(tmp_path, engine=SHORT_TTS, server=server)

    async def run(addr: str) -> None:
        for url in (public, "wss://voice.example.com:443/v1/twilio"):
            async with TwilioSim.call(addr, headers=signed(url)) as sim:
                await answered(sim)
        # the URL this server sees is not the one Twilio signs behind the proxy
        async with TwilioSim.call(addr, headers=signed(f"wss://{addr}/v1/twilio")) as sim:
            assert await refused(sim) == (1008, "twilio_signature_invalid")

    with running_server(path) as addr:
        asyncio.run(run(addr))


@pytest.mark.parametrize("fallback", [True, False])
def test_the_api_key_fallback_can_be_switched_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fallback: bool
) -> None:
    monkeypatch.setenv("TWILIO_AUTH_TOKEN", TOKEN)  # the token from the environment
    server = {"api_keys": ["sk-phone"], "twilio": {"api_key_fallback": fallback}}
    path = write_config(tmp_path, engine=SHORT_TTS, server=server)

    async def run(addr: str) -> None:
        async with TwilioSim.call(addr, headers=signed(f"wss://{addr}/v1/twilio")) as sim:
            await answered(sim)  # signed: no API key needed
        async with TwilioSim.call(addr, {"api_key": "sk-phone"}) as sim:
            if fallback:
                await answered(sim)
            else:
                assert await refused(sim) == (1008, "twilio_signature_missing")
        async with TwilioSim.call(addr, {"api_key": "wrong"}) as sim:
            code, reason = await refused(sim)
            assert code == 1008
            assert reason == ("unauthorized" if fallback else "twilio_signature_missing")

    with running_server(path) as addr:
        asyncio.run(run(addr))


def test_the_token_comes_from_config_or_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TWILIO_AUTH_TOKEN", raising=False)
    assert TwilioConfig().token() is None  # signing off
    monkeypatch.setenv("TWILIO_AUTH_TOKEN", " from-env ")
    assert TwilioConfig().token() == "from-env"
    assert TwilioConfig(auth_token="from-config").token() == "from-config"
    assert TwilioConfig(auth_token_env="").token() is None


def test_the_urls_a_signature_may_sign() -> None:
    assert port_variants("wss://h.example/x") == ["wss://h.example/x", "wss://h.example:443/x"]
    assert port_variants("wss://h.example:443/x") == ["wss://h.example:443/x", "wss://h.example/x"]
    assert port_variants("wss://h.example:8443/x") == ["wss://h.example:8443/x"]
    assert port_variants("wss://[::1]/x")[1] == "wss://[::1]:443/x"
    seen = candidate_urls(None, scheme="ws", host="h.example", path="/v1/twilio", query="a=1")
    assert seen == [
        "wss://h.example/v1/twilio?a=1",
        "wss://h.example:443/v1/twilio?a=1",
        "ws://h.example/v1/twilio?a=1",
        "ws://h.example:80/v1/twilio?a=1",
    ]
    public = candidate_urls("wss://p.example/t", scheme="ws", host="h", path="/t", query="")
    assert public == ["wss://p.example/t", "wss://p.example:443/t"]
