"""What the protocol core asks the session runtime to do: engine calls and local actions.

Engine calls carry the epoch decided by the core; the runtime fences them with the turn and
response counters of ``SessionMachine.fence_for`` when it executes them (they run in order,
so a commit's result is known before the next call is sent).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from duplex_contract.settings import SessionSettings
from duplex_contract.tools import ItemRef, ResponseOptions, ToolOutput
from duplex_server.protocol.codec import AudioFormat
from duplex_server.protocol.config import EffectiveSession
from duplex_server.protocol.events import ServerEvent, TurnDetection


# ---------------------------------------------------------------------------- engine calls
@dataclass(frozen=True, slots=True)
class Append:
    epoch: int
    audio: bytes = b""
    text: str | None = None
    event_id: str | None = None
    item_id: str | None = None  # the text item (or tool output item) this is
    tool_output: ToolOutput | None = None
    stream_ms: float | None = None  # audio: where it starts on the session's input clock
    seq: int | None = None  # the newest client input_seq this completes (input exactly once)


@dataclass(frozen=True, slots=True)
class Commit:
    epoch: int
    respond: bool
    event_id: str | None = None
    item_id: str | None = None  # the user audio item this commit closes
    response: ResponseOptions | None = None  # overrides of the response it asks for
    #: the turn's W3C trace context: set by the runtime when the session is traced (the
    #: core never sets it; duplex_server/ops/tracing.py)
    traceparent: str | None = None


@dataclass(frozen=True, slots=True)
class DeleteItem:
    """``conversation.item.delete``: the engine drops the item from its history."""

    epoch: int
    item: ItemRef
    event_id: str | None = None


@dataclass(frozen=True, slots=True)
class Cancel:
    """Advance the epoch from ``epoch`` to ``epoch + 1`` (barge-in, cancel, input clear)."""

    epoch: int
    event: Literal["barge_in", "response.cancel", "input.cancel"]
    event_id: str | None = None


@dataclass(frozen=True, slots=True)
class Update:
    """The session's engine settings changed: they replace the engine's whole settings."""

    epoch: int
    settings: SessionSettings
    event_id: str | None = None


@dataclass(frozen=True, slots=True)
class Touch:
    epoch: int
    activity: Literal["heartbeat", "playback_ack", "detach"]
    turn_id: int = 0
    response_seq: int = 0
    played_ms: float = 0.0
    truncate: bool = False
    event_id: str | None = None


@dataclass(frozen=True, slots=True)
class CloseSession:
    reason: str
    event_id: str | None = None


@dataclass(frozen=True, slots=True)
class Speculate:
    """The VAD saw a pause inside speech (``input.pause``: transcribe ahead of the commit)
    or speech resumed (``input.resume``: drop that speculation)."""

    epoch: int
    event: Literal["input.pause", "input.resume"]
    event_id: str | None = None
    respond: bool = True  # input.pause: the turn's commit will ask for a response
    traceparent: str | None = None  # input.pause: the turn's trace context (as on Commit)


@dataclass(frozen=True, slots=True)
class Replicate:
    """Keep this front end's state of the session in the engine (duplex_server/session/snapshot.py),
    so another front end can take the session over (docs/scale.md)."""

    state: bytes
    event_id: str | None = None


EngineCommand = (
    Append | Commit | Cancel | Update | Touch | CloseSession | Speculate | DeleteItem | Replicate
)


# ---------------------------------------------------------------------------- local actions
@dataclass(frozen=True, slots=True)
class Send:
    event: ServerEvent


@dataclass(frozen=True, slots=True)
class SendAudio:
    """Reply audio: the engine's PCM16 (mono, ``sample_rate``) and where it belongs.

    The runtime encodes it once to the session's output format: a WebSocket client gets it
    as ``response.output_audio.delta`` (base64, stamped and journaled like any event), a
    media transport plays the encoded PCM without decoding an event."""

    response_id: str
    item_id: str
    epoch: int
    pcm: bytes
    sample_rate: int
    audio_start_ms: float  # where it starts on the item's audio clock
    duration_ms: float  # the engine's own duration


@dataclass(frozen=True, slots=True)
class Call:
    command: EngineCommand


@dataclass(frozen=True, slots=True)
class ProcessAudio:
    """Raw client audio (session input format) for the input lane: decode, resample, VAD."""

    data: bytes


@dataclass(frozen=True, slots=True)
class ConfigureInput:
    """The input format, turn detection or noise reduction changed: rebuild the lane's
    resampler, noise suppressor and VAD."""

    format: AudioFormat
    turn_detection: TurnDetection | None
    noise_reduction: Literal["near_field", "far_field"] | None = None


def configure_input(config: EffectiveSession) -> ConfigureInput:
    """The input lane's settings of the session configuration ``config``."""
    return ConfigureInput(config.input_format, config.turn_detection, config.noise_reduction)


@dataclass(frozen=True, slots=True)
class PurgeAudio:
    """Drop queued audio deltas whose epoch is below ``epoch`` (barge-in)."""

    epoch: int


@dataclass(frozen=True, slots=True)
class AckJournal:
    seq: int


@dataclass(frozen=True, slots=True)
class CloseSocket:
    """Close the attached transport once what is queued for it has been written."""

    code: int
    reason: str


@dataclass(frozen=True, slots=True)
class Takeover:
    """A new transport resumes the session while another is attached: journal what the old
    one never wrote, tell it ``session.replaced`` and close it."""


@dataclass(frozen=True, slots=True)
class Replay:
    """Send the new transport the journaled events after ``after_seq``, then report to
    ``SessionMachine.replayed`` what the journal still had."""

    after_seq: int


@dataclass(frozen=True, slots=True)
class SendStamped:
    """Journaled bytes (a replay), sent as they are."""

    frames: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class DropOutput:
    """The client reads too slowly: discard everything queued for its transport."""


@dataclass(frozen=True, slots=True)
class Release:
    """The attached transport is sent nothing more (it closes after what is queued); later
    events are only journaled."""


Action = (
    Send
    | SendAudio
    | Call
    | ProcessAudio
    | ConfigureInput
    | PurgeAudio
    | AckJournal
    | CloseSocket
    | Takeover
    | Replay
    | SendStamped
    | DropOutput
    | Release
)
