"""The SDK's side of the wire: a server frame decoded to its typed event, a client event
encoded to its JSON text frame (msgspec, once, here)."""

from __future__ import annotations

import msgspec

from duplex_client import events as ev

_DECODER = msgspec.json.Decoder(ev.AnyServerEvent)
_ENCODER = msgspec.json.Encoder()


def decode_event(data: str | bytes) -> ev.AnyServerEvent:
    """One server frame as its typed event; raises ``msgspec.ValidationError`` for an event
    this SDK does not know (a newer server's)."""
    event: ev.AnyServerEvent = _DECODER.decode(data)
    return event


def encode_event(event: ev.ClientEvent) -> str:
    """One client event as the JSON text frame the server reads."""
    return _ENCODER.encode(event).decode()
