"""Python SDK and CLI for duplex-server: :class:`DuplexClient` (asyncio, transparent resume)
and :class:`SyncDuplexClient` (blocking), both built with ``connect``; the event types are
:mod:`duplex_client.events` (``from duplex_client import events as ev``).
"""

from duplex_client import events
from duplex_client.client import (
    ConnectionLost,
    DuplexClient,
    SessionEnded,
    SessionRefused,
    decode_event,
    read_wav,
    to_pcm16,
)
from duplex_client.sync import SyncDuplexClient

__all__ = [
    "ConnectionLost",
    "DuplexClient",
    "SessionEnded",
    "SessionRefused",
    "SyncDuplexClient",
    "decode_event",
    "events",
    "read_wav",
    "to_pcm16",
]
