"""The GPT-Live wire (protocol/live_events.py) and a session's start (live_config.py): strict
decoding with the offending field named, server events as the SDK reads them, and what
``session.start`` may ask for."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from duplex_contract.voices import VoiceCatalog
from duplex_server.protocol.codec import ALAW, PCM16_16K, PCM16_24K, ULAW, encode_server_event
from duplex_server.protocol.errors import ProtocolError
from duplex_server.protocol.live_config import (
    DELEGATE_TOOL,
    LiveOptions,
    effective_session,
    parse_start,
)
from duplex_server.protocol.live_events import (
    LiveCommentaryAppend,
    LiveDelegation,
    LiveDelegationCreated,
    LiveSessionConfig,
    LiveSessionStart,
    audio_delta_frame,
    decode_live_event,
    is_live_frame,
)
from duplex_server.protocol.session_config import EffectiveSession

VOICES = VoiceCatalog.with_openai_aliases(("joe", "amy"))


def _start(session: dict[str, Any], *, websocket: bool = True, **opts: Any) -> Any:
    cfg = msgspec.convert(session, LiveSessionConfig)
    return parse_start(
        cfg,
        options=LiveOptions(**opts),
        default_instructions="be nice",
        served_model="duplex",
        voices=VOICES,
        websocket=websocket,
    )


def _refused(session: dict[str, Any], **kw: Any) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        _start(session, **kw)
    return info.value


# ---------------------------------------------------------------------------- decoding
def test_client_events_decode_strictly_and_name_the_field() -> None:
    e = decode_live_event(
        '{"type":"session.commentary.append","content":"hi","delegation_id":null,"event_id":"c"}'
    )
    assert e == LiveCommentaryAppend(content="hi", delegation_id=None, event_id="c")
    start = decode_live_event('{"type":"session.start","session":{"model":"gpt-live-1"}}')
    assert isinstance(start, LiveSessionStart) and start.session.model == "gpt-live-1"
    cases = [
        (
            '{"type":"session.start","session":{"model":"m","audio":{"nope":1}}}',
            "unknown_parameter",
            "session.audio.nope",
        ),
        ('{"type":"session.input_audio.append"}', "missing_required_parameter", "audio"),
        (
            '{"type":"session.commentary.append","content":"x"}',
            "missing_required_parameter",
            "delegation_id",
        ),
        ('{"type":"session.teleport"}', "unknown_event", "type"),
        (
            '{"type":"session.start","session":{"model":"m","delegation":{"type":"robots"}}}',
            "invalid_value",
            "session.delegation.type",
        ),
        ("not json", "invalid_json", None),
    ]
    for text, code, param in cases:
        with pytest.raises(ProtocolError) as info:
            decode_live_event(text)
        assert (info.value.code, info.value.param) == (code, param), text


def test_server_events_carry_no_seq_and_no_empty_fields() -> None:
    created = LiveDelegationCreated(
        delegation=LiveDelegation(id="deleg_1", target="client", type="delegation"),
        offset_ms=1200,
    )
    data, _ = encode_server_event(created, event_id="event_x0000007", seq=0)
    body = json.loads(data)
    assert body == {
        "type": "session.delegation.created",
        "event_id": "event_x0000007",
        "delegation": {"id": "deleg_1", "target": "client", "type": "delegation"},
        "offset_ms": 1200,
    }
    assert is_live_frame(data)
    assert not is_live_frame(b'{"type":"response.done","response":{}}')
    assert json.loads(audio_delta_frame("AAA=")) == {
        "type": "session.output_audio.delta",
        "delta": "AAA=",
    }


# ---------------------------------------------------------------------------- session.start
def test_models_formats_and_voices() -> None:
    for model in ("gpt-live-1", "gpt-live-1.1", "duplex"):
        assert _start({"model": model}).model == model
    assert _start({"model": "my-live"}, model_aliases=("my-live",)).model == "my-live"
    err = _refused({"model": "gpt-4o-realtime-preview"})
    assert (err.code, err.param) == ("invalid_model", "session.model")
    formats = {
        ("audio/pcm", 16000): PCM16_16K,
        ("audio/pcm", 24000): PCM16_24K,
        ("audio/pcmu", 8000): ULAW,
        ("audio/pcma", 8000): ALAW,
    }
    for (kind, rate), fmt in formats.items():
        start = _start({"model": "gpt-live-1", "audio": {"format": {"type": kind, "rate": rate}}})
        assert start.format == fmt
    assert _start({"model": "gpt-live-1"}).format == PCM16_24K  # the default
    for kind, rate in (("audio/pcm", 8000), ("audio/pcmu", 16000)):
        err = _refused({"model": "gpt-live-1", "audio": {"format": {"type": kind, "rate": rate}}})
        assert (err.code, err.param) == ("invalid_value", "session.audio.format.rate")
    err = _refused(
        {"model": "gpt-live-1", "audio": {"format": {"type": "audio/pcm", "rate": 24000}}},
        websocket=False,
    )
    assert err.param == "session.audio.format"  # WebRTC negotiates its own
    assert _start({"model": "gpt-live-1"}, websocket=False).format is None
    start = _start({"model": "gpt-live-1"})
    assert (start.voice, start.engine_voice) == ("marin", None)  # the engine's default voice
    start = _start({"model": "gpt-live-1", "audio": {"output": {"voice": "willow"}}})
    assert (start.voice, start.engine_voice) == ("willow", None)
    start = _start({"model": "gpt-live-1", "audio": {"output": {"voice": {"id": "amy"}}}})
    assert (start.voice, start.engine_voice) == ("amy", "amy")
    assert (
        _refused({"model": "gpt-live-1", "audio": {"output": {"voice": "nova"}}}).code
        == "forbidden"
    )
    err = _refused({"model": "gpt-live-1", "audio": {"output": {"voice": "zork"}}})
    assert (err.code, err.param) == ("invalid_value", "session.audio.output.voice")


def test_unsupported_features_are_refused_by_name() -> None:
    for extra, param in (
        ({"store": True}, "session.store"),
        ({"triggers": [{"type": "x"}]}, "session.triggers"),
        ({"client": {"data_channel": {}}}, "session.client"),
        ({"delegation": {"type": "decisions", "decisions": {}}}, "session.delegation.type"),
        (
            {
                "delegation": {
                    "type": "responses",
                    "responses": {"model": "b", "tools": [{"type": "web_search"}]},
                }
            },
            "session.delegation.responses.tools.0.type",
        ),
    ):
        err = _refused({"model": "gpt-live-1", **extra})
        assert (err.code, err.param) == ("unsupported", param)
    err = _refused({"model": "gpt-live-1", "delegation": {"type": "responses"}})
    assert (err.code, err.param) == ("missing_required_parameter", "session.delegation.responses")
    err = _refused({"model": "gpt-live-1", "input": [{"role": "user", "content": []}]})
    assert err.param == "session.input.0.content"


def test_the_core_config_of_a_live_session() -> None:
    template = EffectiveSession(voices=VOICES, output_rate=22050)
    plain = _start(
        {"model": "gpt-live-1", "audio": {"format": {"type": "audio/pcmu", "rate": 8000}}}
    )
    cfg = effective_session(plain, template, LiveOptions())
    assert cfg.input_format == cfg.output_format == ULAW
    assert cfg.tools == () and cfg.output_rate == 22050 and cfg.voices is VOICES
    assert cfg.turn_detection is not None and cfg.turn_detection.interrupt_response
    assert cfg.instructions == "be nice"  # the server's default instructions
    delegating = _start(
        {
            "model": "gpt-live-1",
            "instructions": "You book tables.",
            "delegation": {"type": "client", "acknowledgement_delay_ms": 300},
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                {"role": "assistant", "content": [{"type": "output_text", "text": "hello"}]},
            ],
        }
    )
    assert delegating.target == "client" and delegating.ack_delay_ms == 300
    cfg = effective_session(delegating, template, LiveOptions())
    assert cfg.tools == (DELEGATE_TOOL,) and cfg.tool_choice == "auto"
    assert cfg.instructions == "You book tables.\n\nConversation so far:\nUser: hi\nYou: hello"


def test_a_responses_backend_takes_function_tools_and_a_choice() -> None:
    tools = [
        {"type": "function", "name": "lookup", "parameters": {"type": "object"}, "strict": True}
    ]
    start = _start(
        {
            "model": "gpt-live-1",
            "delegation": {
                "type": "responses",
                "responses": {
                    "model": "gpt-5",
                    "instructions": "Look things up.",
                    "tools": tools,
                    "tool_choice": {"type": "function", "name": "lookup"},
                    "max_output_tokens": 50,
                    "reasoning": {"effort": "low"},
                },
            },
        },
        backend_max_output_tokens=200,
    )
    b = start.backend
    assert b.model == "gpt-5" and b.instructions == "Look things up."
    assert [t.name for t in b.tools] == ["lookup"]
    assert (b.tool_choice, b.tool_name, b.max_output_tokens) == ("function", "lookup", 50)
    err = _refused(
        {
            "model": "gpt-live-1",
            "delegation": {
                "type": "responses",
                "responses": {"model": "x", "tool_choice": {"type": "function", "name": "nope"}},
            },
        }
    )
    assert err.param == "session.delegation.responses.tool_choice.name"
