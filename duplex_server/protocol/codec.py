"""Bytes <-> events, and audio formats on the wire. Pure functions; no I/O.

* :func:`decode_client_event` parses one text frame into a typed client event or raises
  :class:`ProtocolError` (``invalid_json``, ``unknown_event``, ``invalid_event``).
* :func:`encode_server_event` stamps ``event_id``/``server_event_seq`` and serialises, with
  the GA or beta event name.
* :class:`AudioFormat` is a normalised wire audio format (the G.711 conversion itself is
  the audio kit's, :mod:`audio_kit.g711`).
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from duplex_contract.validation import explain
from duplex_server.protocol.errors import ProtocolError
from duplex_server.protocol.events import (
    BETA_NAMES,
    AnyClientEvent,
    AudioFormatObj,
    AudioFormatOut,
    BetaFormat,
    ServerEvent,
)

_DECODER = msgspec.json.Decoder(AnyClientEvent)
_ENCODER = msgspec.json.Encoder()


class _Envelope(msgspec.Struct):
    type: Any = None
    event_id: Any = None


def _envelope(data: str | bytes) -> _Envelope:
    try:
        return msgspec.json.decode(data, type=_Envelope)
    except msgspec.DecodeError:
        return _Envelope()


def decode_client_event(data: str | bytes) -> AnyClientEvent:
    """Decode one client text frame. Unknown fields and unknown event types are refused."""
    try:
        event: AnyClientEvent = _DECODER.decode(data)
        return event
    except msgspec.ValidationError as exc:
        env = _envelope(data)
        event_id = env.event_id if isinstance(env.event_id, str) else None
        problem = explain(exc, AnyClientEvent)
        if isinstance(env.type, str) and problem.at == "type":
            raise ProtocolError(
                "unknown_event", f"unknown event type {env.type!r}", param="type", event_id=event_id
            ) from None
        # a missing field is named by where it is missing (the object), as before
        path = problem.at if problem.kind == "missing" else problem.path
        raise ProtocolError(
            "invalid_event", problem.message, param=path or None, event_id=event_id
        ) from None
    except msgspec.DecodeError as exc:
        raise ProtocolError("invalid_json", f"invalid JSON: {exc}") from None


def encode_server_event(
    event: ServerEvent, *, event_id: str, seq: int, beta: bool = False
) -> tuple[bytes, ServerEvent]:
    """Stamp and serialise a server event; returns (JSON bytes, the stamped event)."""
    stamped = msgspec.structs.replace(event, event_id=event_id, server_event_seq=seq)
    data = _ENCODER.encode(stamped)
    if beta:
        tag = type(event).__struct_config__.tag
        beta_name = BETA_NAMES.get(tag) if isinstance(tag, str) else None
        if beta_name is not None:
            # msgspec always writes the tag first: {"type":"<tag>",...
            prefix = b'{"type":"' + tag.encode() + b'"'  # type: ignore[union-attr]
            data = b'{"type":"' + beta_name.encode() + b'"' + data[len(prefix) :]
    return data, stamped


# ============================================================================ audio formats
Codec = Literal["pcm16", "g711_ulaw", "g711_alaw"]


@dataclass(frozen=True, slots=True)
class AudioFormat:
    codec: Codec
    rate: int

    @property
    def beta_name(self) -> str:
        if self.codec == "pcm16":
            return "pcm16" if self.rate == 24000 else "pcm16_16k"
        return self.codec

    @property
    def sample_width(self) -> int:
        """Bytes per sample: 2 for PCM16, 1 for G.711."""
        return 2 if self.codec == "pcm16" else 1

    def duration_ms(self, nbytes: int) -> float:
        """The length of ``nbytes`` of audio in this format (PCM16: 2 bytes a sample)."""
        return nbytes // self.sample_width * 1000.0 / self.rate

    def check_frame(self, nbytes: int) -> None:
        """A binary audio frame must hold whole samples: raises ``invalid_audio_frame``
        (the frame is dropped, the session goes on) for e.g. 3 bytes of PCM16."""
        if nbytes % self.sample_width:
            raise ProtocolError(
                "invalid_audio_frame",
                f"a binary audio frame of {nbytes} bytes is not a whole number of samples: "
                f"the input format {self.wire_name} has {self.sample_width}-byte samples; "
                "the frame was dropped",
            )

    @property
    def wire_name(self) -> str:
        """``audio/pcm (24000 Hz)``, ``audio/pcmu``... as docs/protocol.md writes it."""
        wire = self.to_wire()
        return f"{wire.type} ({self.rate} Hz)" if self.codec == "pcm16" else wire.type

    def to_wire(self) -> AudioFormatOut:
        kind: Literal["audio/pcm", "audio/pcmu", "audio/pcma"] = {
            "pcm16": "audio/pcm",
            "g711_ulaw": "audio/pcmu",
            "g711_alaw": "audio/pcma",
        }[self.codec]  # type: ignore[assignment]
        return AudioFormatOut(type=kind, rate=self.rate)


PCM16_24K = AudioFormat("pcm16", 24000)
PCM16_16K = AudioFormat("pcm16", 16000)
ULAW = AudioFormat("g711_ulaw", 8000)
ALAW = AudioFormat("g711_alaw", 8000)
INPUT_FORMATS = ("pcm16", "pcm16_16k", "g711_ulaw", "g711_alaw")
OUTPUT_FORMATS = ("pcm16", "g711_ulaw", "g711_alaw")

_BETA: dict[str, AudioFormat] = {
    "pcm16": PCM16_24K,
    "pcm16_16k": PCM16_16K,
    "g711_ulaw": ULAW,
    "g711_alaw": ALAW,
}


def parse_format(param: AudioFormatObj | BetaFormat, *, field: str, output: bool) -> AudioFormat:
    """Normalise a GA format object or a beta name; refuse what the server cannot do."""
    if isinstance(param, str):
        fmt = _BETA[param]
    elif param.type == "audio/pcmu":
        fmt = ULAW
    elif param.type == "audio/pcma":
        fmt = ALAW
    else:
        rate = 24000 if isinstance(param.rate, msgspec.UnsetType) else param.rate
        if rate not in (16000, 24000):
            raise ProtocolError(
                "invalid_value", f"audio/pcm rate must be 16000 or 24000, got {rate}", param=field
            )
        fmt = AudioFormat("pcm16", rate)
    if output and fmt == PCM16_16K:
        raise ProtocolError("unsupported", "output pcm16 is 24000 Hz only", param=field)
    return fmt


def decode_audio_b64(audio: str) -> bytes:
    try:
        return base64.b64decode(audio, validate=True)
    except (binascii.Error, ValueError):
        raise ProtocolError("invalid_audio", "audio is not valid base64", param="audio") from None


def encode_audio_b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")
