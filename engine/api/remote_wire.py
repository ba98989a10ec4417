"""The engine socket's wire format: frames of a 4-byte big-endian length and a msgpack
body, and the handshake and figures messages that travel beside engine/messages.py's
requests and outputs (engine/api/remote.py serves them, engine/api/remote_client.py reads them)."""

from __future__ import annotations

import asyncio
import struct

import msgspec

from duplex_contract.control import ControlResult
from duplex_contract.session_events import Msg
from engine.api.client import EngineStats
from engine.config import EngineConfig
from engine.messages import (
    AbortRequest,
    BatchOutput,
    ControlRequest,
    EngineFatal,
    GenerateRequest,
    SessionOutput,
)

PROTOCOL = 1
MAX_FRAME = 64 * 1024 * 1024  # bytes in one frame (an audio append is at most 16 MiB)
_LEN = struct.Struct(">I")


class Hello(Msg, frozen=True, tag="hello"):
    protocol: int
    name: str = ""


class Welcome(Msg, frozen=True, tag="welcome"):
    protocol: int
    engine_id: str
    config: EngineConfig
    #: the engine keeps its sessions in a store (``engine.duplex.store_path``): when it
    #: exits, a front end waits for it to come back and attaches its sessions again
    durable: bool = False


class Refused(Msg, frozen=True, tag="refused"):
    message: str


class StatsPush(Msg, frozen=True, tag="stats_push"):
    """Engine-wide figures, pushed to every front end a few times a second."""

    stats: EngineStats
    stage_latency: list[tuple[str, float]] = []
    stage_steps: list[tuple[str, int]] = []
    stage_waits: list[tuple[str, float]] = []
    stage_decodes: list[tuple[str, float, float]] = []


FrontMessage = Hello | ControlRequest | GenerateRequest | AbortRequest
EngineMessage = (
    Welcome | Refused | ControlResult | SessionOutput | BatchOutput | EngineFatal | StatsPush
)
FRONT_DECODER = msgspec.msgpack.Decoder(FrontMessage)
ENGINE_DECODER = msgspec.msgpack.Decoder(EngineMessage)
_ENCODER = msgspec.msgpack.Encoder()


def frame(msg: Msg) -> bytes:
    body = _ENCODER.encode(msg)
    return _LEN.pack(len(body)) + body


async def read_frame(reader: asyncio.StreamReader) -> bytes | None:
    """One frame's body, or None at a clean end of stream."""
    try:
        head = await reader.readexactly(_LEN.size)
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise ConnectionError("the stream ended inside a frame header") from None
        return None
    (size,) = _LEN.unpack(head)
    if size > MAX_FRAME:
        raise ConnectionError(f"frame of {size} bytes is over the {MAX_FRAME} limit")
    try:
        return await reader.readexactly(size)
    except asyncio.IncompleteReadError:
        raise ConnectionError("the stream ended inside a frame") from None
