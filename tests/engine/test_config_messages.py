from pathlib import Path

import msgspec
import pytest

from duplex_contract.control import AppendCall
from duplex_contract.errors import ConfigError, ControlError, EngineDeadError
from duplex_contract.fence import Fence
from duplex_contract.session_events import ErrorInfo
from engine.config import load_engine_config
from engine.messages import ControlRequest, decode_request, encode

ROOT = Path(__file__).resolve().parents[2]


def test_test_config_loads() -> None:
    cfg = load_engine_config(ROOT / "configs" / "test.yaml")
    assert cfg.stages["llm"].backend == "test"
    assert cfg.routes["voice"] == ("asr", "llm", "tts")
    assert cfg.duplex.max_sessions == 1000


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (
            "engine: {stages: {asr: {backend: test}, llm: {backend: test, replicas: 0}, "
            "tts: {backend: test}}, routes: {voice: [asr, llm, tts]}}",
            "engine.stages.llm.replicas",
        ),
        (
            "engine: {stages: {asr: {backend: test}, llm: {backend: test}, tts: {backend: test}}, "
            "routes: {voice: [asr, llm, tts]}, bogus: 1}",
            "engine.bogus",
        ),
        ("engine: {stages: {asr: {backend: test}, tts: {backend: test}}}", "engine.routes"),
        (
            "engine: {stages: {asr: {backend: test}, llm: {backend: test}, tts: {backend: test}}, "
            "routes: {voice: [asr, llm, tts]}, duplex: {idle_ttl_s: -1}}",
            "engine.duplex.idle_ttl_s",
        ),
    ],
)
def test_bad_config_names_the_field(tmp_path: Path, body: str, field: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(body)
    with pytest.raises(ConfigError) as info:
        load_engine_config(path)
    assert str(info.value).startswith(field), str(info.value)


def test_fence_staleness_rules() -> None:
    cur = Fence("s", epoch=2, turn_id=3, response_seq=1)
    assert Fence("s", 1, 9, 9).is_stale_against(cur)
    assert Fence("s", 2, 2, 1).is_stale_against(cur)
    assert Fence("s", 2, 3, 0).is_stale_against(cur)
    assert not Fence("s", 2, 3, 1).is_stale_against(cur)
    assert not Fence("s", 3, 0, 0).is_stale_against(cur)
    assert Fence("other", 9, 9, 9).is_stale_against(cur)
    assert cur.key() == "s/e2/t3/r1"


def test_messages_round_trip_and_refuse_unknown_fields() -> None:
    req = ControlRequest(
        control_id=7, call=AppendCall(fence=Fence("s"), lease_generation=1, audio=b"\x00\x01")
    )
    assert decode_request(encode(req)) == req
    raw = msgspec.msgpack.decode(encode(req))
    raw["call"]["surprise"] = 1
    with pytest.raises(msgspec.ValidationError, match="surprise"):
        decode_request(msgspec.msgpack.encode(raw))
    raw["call"].pop("surprise")
    raw["call"]["type"] = "nope"
    with pytest.raises(msgspec.ValidationError):
        decode_request(msgspec.msgpack.encode(raw))


def test_errors_cross_as_typed_messages() -> None:
    info = ErrorInfo.from_exc(ControlError("old", code="stale_fence"), session_id="s")
    exc = info.to_exc()
    assert isinstance(exc, ControlError) and exc.code == "stale_fence" and not exc.retryable
    dead = ErrorInfo.from_exc(EngineDeadError("boom"))
    assert dead.fatal and isinstance(dead.to_exc(), EngineDeadError)
    busy = ErrorInfo.from_exc(ControlError("full", code="resource_exhausted"))
    assert busy.retryable
