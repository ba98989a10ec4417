"""Python SDK and CLI for duplex-server: :class:`DuplexClient` (asyncio, transparent resume)
and :class:`SyncDuplexClient` (blocking), both built with ``connect``; the event types are
:mod:`duplex_client.events` (``from duplex_client import events as ev``).
"""

from duplex_client import events
from duplex_client.audio_input import read_wav, to_pcm16
from duplex_client.client import DuplexClient
from duplex_client.errors import ConnectionLost, SessionEnded, SessionRefused
from duplex_client.sync import SyncDuplexClient
from duplex_client.wire import decode_event

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
