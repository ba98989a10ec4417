"""Twilio Media Streams' wire messages (duplex_server/transports/twilio_wire.py): Twilio's
documented
messages decode to typed structs, what we send encodes to Twilio's shape, and every message
the server cannot use is refused with a reason (then logged, counted, and the call goes
on: the server test at the end)."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import websockets

from duplex_server.transports import twilio_wire as wire
from tests.server.harness import http_text, running_server, write_config
from tests.server.twilio_sim import TwilioSim, tone8k

SID = "MZ18ad3ab5a668481ce02b83e7395059f0"

#: Twilio's own examples (Media Streams "WebSocket messages" reference), trimmed of nothing
START: dict[str, Any] = {
    "event": "start",
    "sequenceNumber": "1",
    "start": {
        "accountSid": "AC123",
        "streamSid": SID,
        "callSid": "CA123",
        "tracks": ["inbound"],
        "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1},
        "customParameters": {"session": '{"instructions": "hi"}', "api_key": "sk-1"},
    },
    "streamSid": SID,
}


def _text(obj: dict[str, Any]) -> str:
    return json.dumps(obj)


def test_twilios_messages_decode_to_typed_structs() -> None:
    connected = wire.decode(_text({"event": "connected", "protocol": "Call", "version": "1.0.0"}))
    assert connected == wire.Connected(protocol="Call", version="1.0.0")

    start = wire.decode(_text(START))
    assert isinstance(start, wire.Start)
    assert start.stream_sid == SID and start.body.callSid == "CA123"
    assert start.body.media_format == wire.MediaFormat("audio/x-mulaw", 8000, 1)
    assert start.body.parameters["api_key"] == "sk-1"

    ulaw = bytes(range(160))
    media = wire.decode(
        _text(
            {
                "event": "media",
                "sequenceNumber": "3",
                "media": {
                    "track": "inbound",
                    "chunk": "1",
                    "timestamp": "5",
                    "payload": base64.b64encode(ulaw).decode(),
                },
                "streamSid": SID,
            }
        )
    )
    assert isinstance(media, wire.Media)
    assert media.media.payload == ulaw and media.inbound and media.sequenceNumber == "3"
    outbound = wire.decode(_text({"event": "media", "media": {"track": "outbound", "payload": ""}}))
    assert isinstance(outbound, wire.Media) and not outbound.inbound

    mark = wire.decode(_text({"event": "mark", "streamSid": SID, "mark": {"name": "item_7:1200"}}))
    assert isinstance(mark, wire.Mark) and mark.position() == ("item_7", 1200.0)

    dtmf = wire.decode(
        _text({"event": "dtmf", "streamSid": SID, "dtmf": {"track": "inbound_track", "digit": "#"}})
    )
    assert isinstance(dtmf, wire.Dtmf) and dtmf.dtmf.digit == "#"

    stop = wire.decode(_text({"event": "stop", "streamSid": SID, "stop": {"callSid": "CA123"}}))
    assert isinstance(stop, wire.Stop) and stop.stop == wire.StopBody(callSid="CA123")


def test_start_defaults_and_lenient_numbers() -> None:
    """A start without mediaFormat (or with null) means Twilio's one format; the stream id
    may ride the message instead of its body; a sample rate sent as a string is still a
    number; a format the server cannot take decodes (twilio.py refuses it with a reason)."""
    msg = wire.decode(_text({"event": "start", "streamSid": "MZ1", "start": {}}))
    assert isinstance(msg, wire.Start)
    assert msg.stream_sid == "MZ1"
    assert msg.body.media_format.encoding == wire.ENCODING
    assert msg.body.media_format.sampleRate == wire.RATE
    assert msg.body.parameters == {}
    loose = wire.decode(_text({"event": "start", "start": {"mediaFormat": {"sampleRate": "8000"}}}))
    assert isinstance(loose, wire.Start) and loose.body.media_format.sampleRate == 8000
    nulls = wire.decode(
        '{"event": "start", "start": {"mediaFormat": null, "customParameters": null}}'
    )
    assert isinstance(nulls, wire.Start)
    assert nulls.body.media_format.sampleRate == wire.RATE and nulls.body.parameters == {}
    mulaw16k = wire.decode(
        _text({"event": "start", "start": {"mediaFormat": {"sampleRate": 16000}}})
    )
    assert isinstance(mulaw16k, wire.Start) and mulaw16k.body.media_format.sampleRate == 16000


@pytest.mark.parametrize(
    ("text", "event", "why"),
    [
        ("not json", None, "not JSON"),
        ("[1, 2]", None, "no 'event' field"),
        ("{}", None, "no 'event' field"),
        ('{"event": 5}', None, "no 'event' field"),
        ('{"event": "bogus"}', "bogus", "unknown event 'bogus'"),
        ('{"event": "media"}', "media", "missing required field `media`"),
        ('{"event": "media", "media": {}}', "media", "`payload` - at `$.media`"),
        ('{"event": "media", "media": {"payload": "*"}}', "media", "Invalid base64"),
        ('{"event": "media", "media": {"payload": 7}}', "media", "at `$.media.payload`"),
        ('{"event": "mark", "mark": {}}', "mark", "`name` - at `$.mark`"),
        ('{"event": "dtmf"}', "dtmf", "missing required field `dtmf`"),
        ('{"event": "start", "start": "x"}', "start", "at `$.start`"),
        ('{"event": "start", "start": {"customParameters": {"a": 1}}}', "start", "customParam"),
    ],
)
def test_malformed_messages_say_why(text: str, event: str | None, why: str) -> None:
    with pytest.raises(wire.Malformed) as info:
        wire.decode(text)
    assert info.value.event == event
    assert why in str(info.value)


def test_what_a_message_means_is_checked_where_it_is_read() -> None:
    start = wire.decode('{"event": "start"}')
    assert isinstance(start, wire.Start)
    with pytest.raises(wire.Malformed, match="without a 'start' object"):
        _ = start.body
    for name in ("x", "item_1:late"):
        mark = wire.decode(_text({"event": "mark", "mark": {"name": name}}))
        assert isinstance(mark, wire.Mark)
        with pytest.raises(wire.Malformed, match="mark"):
            mark.position()


def test_what_we_send_has_twilios_shape() -> None:
    media = wire.encode(wire.SendMedia(streamSid=SID, media=wire.OutMedia("AAAA")))
    assert media == '{"event":"media","streamSid":"' + SID + '","media":{"payload":"AAAA"}}'
    mark = wire.encode(wire.SendMark(streamSid=SID, mark=wire.OutMark("item_1:100")))
    assert json.loads(mark) == {"event": "mark", "streamSid": SID, "mark": {"name": "item_1:100"}}
    assert json.loads(wire.encode(wire.Clear(streamSid=SID))) == {
        "event": "clear",
        "streamSid": SID,
    }


def test_the_server_logs_why_a_message_is_malformed_and_the_call_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = write_config(tmp_path)
    bad = {
        '{"event": "bogus"}': "unknown event 'bogus'",
        '{"event": "mark", "mark": {}}': "`name` - at `$.mark`",
        '{"event": "media", "media": {"payload": "*"}}': "Invalid base64",
    }

    async def run(addr: str) -> None:
        async with TwilioSim.call(addr) as sim:
            for text in bad:
                await sim.ws.send(text)
            sim.speak(tone8k(500))
            await sim.wait(lambda: sim.media_in > 0, within=10)
            assert not sim.closed.is_set()
        body = http_text(addr, "/metrics")
        line = next(x for x in body.splitlines() if 'code="twilio_malformed"' in x)
        assert float(line.split()[-1]) == len(bad)

    with caplog.at_level(logging.WARNING, logger="duplex_server.transports.twilio"):
        with running_server(path) as addr:
            asyncio.run(run(addr))
    logged = [r.getMessage() for r in caplog.records if "malformed message ignored" in r.message]
    assert len(logged) == len(bad)
    for line, why in zip(logged, bad.values(), strict=True):
        assert why in line, line


def test_a_start_in_a_format_the_server_cannot_take_opens_no_session(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = write_config(tmp_path)
    apps: list[Any] = []
    start = {**START, "start": {**START["start"], "mediaFormat": {"encoding": "audio/x-l16"}}}

    async def run(addr: str) -> None:
        async with websockets.connect(f"ws://{addr}/v1/twilio") as ws:
            await ws.send(_text({"event": "connected", "protocol": "Call", "version": "1.0.0"}))
            await ws.send(_text(start))
            await ws.send(_text({"event": "media", "media": {"payload": "AAAA"}}))  # ignored
            await asyncio.sleep(0.3)
            assert not apps[0].state.hub.sessions.live
            await ws.send(_text({"event": "stop"}))
            await asyncio.wait_for(ws.wait_closed(), 5)

    with caplog.at_level(logging.WARNING, logger="duplex_server.transports.twilio"):
        with running_server(path, apps=apps) as addr:
            asyncio.run(run(addr))
    (line,) = [r.getMessage() for r in caplog.records if "malformed" in r.getMessage()]
    assert "unsupported mediaFormat" in line and "audio/x-l16" in line
