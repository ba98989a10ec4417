"""Twilio Media Streams' wire messages, typed (msgspec), and their one decoder and encoder.

What Twilio sends (one JSON object per text frame, named by ``event``; Twilio's field
names, camelCase as on the wire; fields we do not use are accepted and ignored):

==============  ==========================================================================
``connected``   the socket is up (``protocol``, ``version``)
``start``       the stream: ``start.streamSid``, ``start.mediaFormat`` (G.711 mu-law,
                8000 Hz), ``start.customParameters`` (TwiML ``<Parameter>``, strings)
``media``       caller audio: ``media.payload`` (base64 mu-law, 20 ms), ``media.track``
``mark``        a mark we sent has been played: ``mark.name``
``dtmf``        a keypad digit: ``dtmf.digit`` (``dtmf.track``)
``stop``        the stream ended
==============  ==========================================================================

What we send: ``media`` (reply audio, base64 mu-law), ``mark`` (named
``<item_id>:<end_ms>``) and ``clear`` (drop what is buffered: a barge-in).

:func:`decode` is the one decoder (a tagged union on ``event``); every message it cannot
use raises :class:`Malformed` with a message that says why (not JSON, no ``event``, an
unknown event, a missing or mistyped field with its JSON path, a payload that is not
base64). :func:`encode` writes what we send.
"""

from __future__ import annotations

from typing import Literal, TypeAlias

import msgspec

#: Twilio's only media format on a Media Stream
ENCODING = "audio/x-mulaw"
RATE = 8000


class Malformed(ValueError):
    """A Twilio message this server cannot use; ``event``: its event name, if it has one."""

    def __init__(self, why: str, event: str | None = None) -> None:
        super().__init__(why)
        self.event = event


# ---------------------------------------------------------------------------- inbound
class _Body(msgspec.Struct, frozen=True):
    """A nested object of an inbound message."""


class MediaFormat(_Body, frozen=True):
    encoding: str = ENCODING
    sampleRate: int = RATE
    channels: int = 1


_TWILIO_FORMAT = MediaFormat()


class StartBody(_Body, frozen=True):
    streamSid: str = ""
    accountSid: str = ""
    callSid: str = ""
    tracks: list[str] = []
    mediaFormat: MediaFormat | None = None  # None: Twilio's one format
    customParameters: dict[str, str] | None = None

    @property
    def media_format(self) -> MediaFormat:
        return self.mediaFormat or _TWILIO_FORMAT

    @property
    def parameters(self) -> dict[str, str]:
        """The TwiML ``<Parameter>`` values (none: empty)."""
        return self.customParameters or {}


class MediaBody(_Body, frozen=True):
    payload: bytes  # base64 on the wire: decoded (and checked) by the decoder
    track: str = "inbound"
    chunk: str = ""
    timestamp: str = ""


class MarkBody(_Body, frozen=True):
    name: str


class DtmfBody(_Body, frozen=True):
    digit: str
    track: str = "inbound_track"


class StopBody(_Body, frozen=True):
    accountSid: str = ""
    callSid: str = ""


class _Message(msgspec.Struct, frozen=True, kw_only=True, tag_field="event"):
    """An inbound message; ``streamSid`` and ``sequenceNumber`` ride most of them."""

    streamSid: str = ""
    sequenceNumber: str = ""


class Connected(_Message, frozen=True, tag="connected"):
    protocol: str = ""
    version: str = ""


class Start(_Message, frozen=True, tag="start"):
    start: StartBody | None = None

    @property
    def body(self) -> StartBody:
        if self.start is None:
            raise Malformed("start without a 'start' object", "start")
        return self.start

    @property
    def stream_sid(self) -> str:
        return self.body.streamSid or self.streamSid


class Media(_Message, frozen=True, tag="media"):
    media: MediaBody

    @property
    def inbound(self) -> bool:
        """The caller's audio (a stream may carry the outbound track too)."""
        return self.media.track in ("inbound", "inbound_track")


class Mark(_Message, frozen=True, tag="mark"):
    mark: MarkBody

    def position(self) -> tuple[str, float]:
        """The item and end (ms) a mark we sent names (``<item_id>:<end_ms>``)."""
        name = self.mark.name
        item, sep, end = name.rpartition(":")
        if not sep:
            raise Malformed("mark without a name we sent", "mark")
        try:
            return item, float(end)
        except ValueError:
            raise Malformed(f"mark {name!r} is not one we sent", "mark") from None


class Dtmf(_Message, frozen=True, tag="dtmf"):
    dtmf: DtmfBody


class Stop(_Message, frozen=True, tag="stop"):
    stop: StopBody | None = None


Inbound: TypeAlias = Connected | Start | Media | Mark | Dtmf | Stop
EVENTS = frozenset(("connected", "start", "media", "mark", "dtmf", "stop"))

_decoder: msgspec.json.Decoder[Inbound] = msgspec.json.Decoder(Inbound, strict=False)


class _Event(msgspec.Struct):
    event: str


_peek = msgspec.json.Decoder(_Event)


def _event_of(text: str | bytes) -> str | None:
    try:
        return _peek.decode(text).event
    except msgspec.DecodeError:
        return None


def decode(text: str | bytes) -> Inbound:
    """One Twilio message, typed; raises :class:`Malformed` (with why) if unusable."""
    try:
        return _decoder.decode(text)
    except msgspec.ValidationError as exc:
        event = _event_of(text)
        if event is None:
            raise Malformed(f"no 'event' field ({exc})") from None
        if event not in EVENTS:
            raise Malformed(f"unknown event {event!r}", event) from None
        raise Malformed(f"{event}: {exc}", event) from None
    except msgspec.DecodeError as exc:
        raise Malformed(f"not JSON: {exc}") from None


# ---------------------------------------------------------------------------- outbound
class OutMedia(msgspec.Struct, frozen=True):
    payload: str  # base64 mu-law (the audio delta's own base64)


class OutMark(msgspec.Struct, frozen=True):
    name: str


class SendMedia(msgspec.Struct, frozen=True, kw_only=True):
    event: Literal["media"] = "media"
    streamSid: str
    media: OutMedia


class SendMark(msgspec.Struct, frozen=True, kw_only=True):
    event: Literal["mark"] = "mark"
    streamSid: str
    mark: OutMark


class Clear(msgspec.Struct, frozen=True, kw_only=True):
    event: Literal["clear"] = "clear"
    streamSid: str


Outbound: TypeAlias = SendMedia | SendMark | Clear

_encoder = msgspec.json.Encoder()


def encode(msg: Outbound) -> str:
    """What we send, as the text frame's JSON."""
    return _encoder.encode(msg).decode()
