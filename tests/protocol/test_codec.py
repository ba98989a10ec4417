"""Pure codec tests: frames in, typed events out; events in, bytes out. No sockets."""

from __future__ import annotations

import json

import pytest

from duplex_server.protocol import events as ev
from duplex_server.protocol.codec import (
    ALAW,
    PCM16_16K,
    ULAW,
    decode_audio_b64,
    decode_client_event,
    encode_server_event,
    parse_format,
)
from duplex_server.protocol.errors import ProtocolError
from duplex_server.session.attach import Journal, Outbox, Outgoing, new_resume_token, token_matches


def test_decodes_each_client_event_type() -> None:
    frames = {
        '{"type":"session.update","session":{"instructions":"x"}}': ev.SessionUpdate,
        '{"type":"input_audio_buffer.append","audio":"AAA="}': ev.InputAudioBufferAppend,
        '{"type":"input_audio_buffer.commit"}': ev.InputAudioBufferCommit,
        '{"type":"response.create","event_id":"e1"}': ev.ResponseCreate,
        '{"type":"response.cancel"}': ev.ResponseCancel,
        '{"type":"session.resume","session_id":"s","resume_token":"t"}': ev.SessionResume,
        '{"type":"playback.ack","item_id":"i","played_ms":12.5}': ev.PlaybackAck,
        '{"type":"barge_in"}': ev.BargeIn,
    }
    for frame, cls in frames.items():
        assert isinstance(decode_client_event(frame), cls)


@pytest.mark.parametrize(
    ("frame", "code", "param"),
    [
        ("{not json", "invalid_json", None),
        ('{"type":"nope.nope","event_id":"e7"}', "unknown_event", "type"),
        ('{"type":"input_audio_buffer.append"}', "invalid_event", None),
        ('{"type":"response.cancel","bogus":1}', "invalid_event", "bogus"),
        ('{"type":"session.update","session":{"voice":3}}', "invalid_event", "session.voice"),
    ],
)
def test_refuses_bad_frames_with_codes(frame: str, code: str, param: str | None) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_client_event(frame)
    assert info.value.code == code
    assert info.value.param == param
    if "e7" in frame:
        assert info.value.event_id == "e7"


def test_encode_stamps_and_spells_beta() -> None:
    delta = ev.AudioDelta(
        response_id="r", item_id="i", delta="AA==", epoch=2, audio_start_ms=0.0, duration_ms=100.0
    )
    data, _ = encode_server_event(delta, event_id="event_1", seq=7)
    obj = json.loads(data)
    assert obj["type"] == "response.output_audio.delta"
    assert (obj["event_id"], obj["server_event_seq"], obj["epoch"]) == ("event_1", 7, 2)
    beta, _ = encode_server_event(delta, event_id="event_1", seq=7, beta=True)
    assert json.loads(beta)["type"] == "response.audio.delta"
    assert json.loads(beta)["delta"] == "AA=="


def test_formats() -> None:
    assert parse_format("g711_ulaw", field="f", output=False) == ULAW
    assert parse_format(ev.AudioFormatObj(type="audio/pcma"), field="f", output=False) == ALAW
    assert parse_format(ev.AudioFormatObj(rate=16000), field="f", output=False) == PCM16_16K
    with pytest.raises(ProtocolError) as info:
        parse_format(ev.AudioFormatObj(rate=44100), field="f", output=False)
    assert info.value.code == "invalid_value"


def test_base64_errors() -> None:
    assert decode_audio_b64("AAE=") == b"\x00\x01"
    with pytest.raises(ProtocolError) as info:
        decode_audio_b64("***")
    assert info.value.code == "invalid_audio"


def test_resume_token_is_hashed_and_compared() -> None:
    token, digest = new_resume_token()
    assert len(token) >= 43 and token.encode() not in digest
    assert token_matches(token, digest)
    assert not token_matches(token + "x", digest)


def test_journal_replay_ack_and_overflow() -> None:
    j = Journal(max_bytes=100, max_age_s=60)
    for seq in range(1, 6):
        j.append(seq, b"x" * 10, now=0.0)
    assert j.replay_after(2, now=1.0) == [b"x" * 10] * 3
    assert j.replay_after(9, now=1.0) is None  # a seq we never sent: gap
    for seq in range(6, 20):
        j.append(seq, b"y" * 10, now=2.0)
    assert j.bytes <= 100
    assert j.replay_after(3, now=3.0) is None  # events 4.. were dropped unacknowledged
    assert j.replay_after(18, now=3.0) == [b"y" * 10]
    j.append(20, b"z", now=100.0)  # age expiry drops the rest
    assert j.replay_after(18, now=100.0) is None


def test_outbox_bounds_and_purges() -> None:
    box = Outbox(max_bytes=1000)
    assert box.put(Outgoing(None, b"a", 600, epoch=0))
    assert not box.put(Outgoing(None, b"b", 600, epoch=0))  # over budget: slow client
    assert box.put(Outgoing(None, b"c", 100, epoch=1))
    assert box.purge_audio(1) == 1
    item = box.pop()
    assert item is not None and item.raw == b"c"
    assert box.pop() is None and box.nbytes == 0
