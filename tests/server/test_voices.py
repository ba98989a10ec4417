"""Voice names are checked against the engine's speaking stage: its own voices and OpenAI's
names (aliases of the default) are accepted, anything else is refused with the list, on the
WebSocket and on the HTTP routes; ``GET /v1/voices`` lists them."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from duplex_contract.voices import OPENAI_VOICES, VoiceCatalog
from duplex_server.config import load_app_config
from duplex_server.protocol.errors import ProtocolError
from duplex_server.protocol.events import SessionParam
from duplex_server.protocol.session_config import EffectiveSession, apply_patch
from engine.voices import voices_of
from tests.server.harness import ROOT, TEST_YAML, UNIT, Client, running_server, write_config

VOICES = {"stages": {"tts": {"options": {"voices": ["test", "bright"]}}}}
ALIASES = ", ".join(OPENAI_VOICES)
LISTED = f"the voices are: test (default), bright; aliases of test: {ALIASES}"


@pytest.fixture(scope="module")
def voiced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with running_server(write_config(tmp_path_factory.mktemp("voices"), VOICES)) as addr:
        yield addr


def _engine(tmp: Path, tts: dict[str, object], drop: tuple[str, ...] = ()) -> VoiceCatalog | None:
    """The voices of configs/test.yaml with another TTS stage, without the routes ``drop``."""
    raw = yaml.safe_load(TEST_YAML.read_text())
    raw["engine"]["stages"]["tts"] = tts
    for route in drop:
        del raw["engine"]["routes"][route]
    path = tmp / "voices.yaml"
    path.write_text(yaml.safe_dump(raw))
    return voices_of(load_app_config(path).engine)


def test_each_speaking_backend_says_its_voices(tmp_path: Path) -> None:
    cpu = voices_of(load_app_config(ROOT / "configs" / "cpu.yaml").engine)
    assert cpu == VoiceCatalog(("en_US-joe-medium",), OPENAI_VOICES)  # the one Piper voice
    piper = _engine(tmp_path, {"backend": "piper", "options": {"model_path": "/v/de_DE-x.onnx"}})
    assert piper is not None and piper.voices == ("de_DE-x",)
    espeak = _engine(tmp_path, {"backend": "espeak", "options": {"voice": "fr"}})
    assert espeak is not None and espeak.voices == ("fr",)
    remote = _engine(
        tmp_path,
        {"backend": "openai", "options": {"base_url": "http://x/v1", "voice": "coral"}},
    )
    assert remote is not None  # OpenAI's names are its own voices, forwarded, not aliases
    assert remote.default == "coral" and set(remote.voices) == set(OPENAI_VOICES)
    assert remote.aliases == ()
    assert remote.resolve("nova") == "nova"
    # no speaking route, no catalog: nothing to check against
    assert _engine(tmp_path, {"backend": "test"}, drop=("voice", "speech")) is None


def test_the_catalog_resolves_aliases_and_lists_the_voices() -> None:
    cat = VoiceCatalog.with_openai_aliases(("tara", "leo", "tara"))
    assert cat.voices == ("tara", "leo") and cat.default == "tara"
    assert cat.resolve("leo") == "leo" and cat.resolve("alloy") == "tara"
    assert cat.resolve(None) is None
    assert cat.problem("alloy") is None and cat.problem("leo") is None
    assert cat.problem("nobody") == (
        f"unknown voice 'nobody'; the voices are: tara (default), leo; aliases of tara: {ALIASES}"
    )
    with pytest.raises(ValueError):
        VoiceCatalog(())


def test_a_session_checks_the_voice_and_tells_the_engine_the_real_one() -> None:
    base = EffectiveSession(voices=VoiceCatalog.with_openai_aliases(("test", "bright")))
    nova = apply_patch(base, SessionParam(voice="nova"))
    assert nova.voice == "nova"  # echoed as the client named it
    assert nova.settings().voice == "test"  # the engine speaks the default voice
    assert apply_patch(base, SessionParam(voice="bright")).settings().voice == "bright"
    with pytest.raises(ProtocolError) as err:
        apply_patch(base, SessionParam(voice="definitely-not-a-voice"))
    assert (err.value.code, err.value.param) == ("invalid_value", "voice")
    assert err.value.message == f"voice: unknown voice 'definitely-not-a-voice'; {LISTED}"
    unchecked = apply_patch(EffectiveSession(), SessionParam(voice="anything"))
    assert unchecked.settings().voice == "anything"  # no catalog: passed on


def test_the_websocket_refuses_an_unknown_voice(voiced: str) -> None:
    async def run() -> None:
        async with Client.connect(voiced) as c:
            await c.until("session.created")
            for name in ("nova", "bright"):
                out = {"audio": {"output": {"voice": name}}}
                await c.send({"type": "session.update", "session": out})
                updated = await c.until("session.updated")
                assert updated["session"]["audio"]["output"]["voice"] == name
            bad = {"audio": {"output": {"voice": "definitely-not-a-voice"}}}
            await c.send({"type": "session.update", "session": bad})
            err = (await c.until("error"))["error"]
            assert err["code"] == "invalid_value" and err["param"] == "audio.output.voice"
            assert err["message"] == (
                f"audio.output.voice: unknown voice 'definitely-not-a-voice'; {LISTED}"
            )

    asyncio.run(run())


def test_the_http_routes_refuse_an_unknown_voice_and_list_the_voices(voiced: str) -> None:
    url = f"http://{voiced}/v1"
    for name in ("nova", "bright"):
        body = {"model": "tts-1", "input": "Hi.", "voice": name, "response_format": "wav"}
        assert httpx.post(f"{url}/audio/speech", json=body, timeout=30 * UNIT).status_code == 200
    body = {"model": "tts-1", "input": "Hi.", "voice": "definitely-not-a-voice"}
    resp = httpx.post(f"{url}/audio/speech", json=body, timeout=30 * UNIT)
    assert resp.status_code == 400
    assert resp.json()["error"] == {
        "message": f"voice: unknown voice 'definitely-not-a-voice'; {LISTED}",
        "type": "invalid_request_error",
        "param": "voice",
        "code": "invalid_value",
    }
    chat = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "modalities": ["text", "audio"],
        "audio": {"voice": "nobody", "format": "wav"},
    }
    resp = httpx.post(f"{url}/chat/completions", json=chat, timeout=30 * UNIT)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "audio.voice"
    listed = httpx.get(f"{url}/voices", timeout=10 * UNIT).json()
    assert listed["object"] == "list" and listed["default"] == "test"
    assert listed["data"][:3] == [
        {"id": "test", "object": "voice", "default": True},
        {"id": "bright", "object": "voice", "default": False},
        {"id": "alloy", "object": "voice", "default": False, "alias_of": "test"},
    ]
    assert [v["id"] for v in listed["data"]] == ["test", "bright", *OPENAI_VOICES]
