"""What the protocol core asks the session runtime to do: engine calls and local actions.

Each engine command is one control call of the contract (:mod:`duplex_contract.control`)
that the core decided, less what only the runtime knows when it makes the call: the fence
(the core decides its epoch; the runtime fences it with the turn and response counters of
``SessionMachine.fence_for`` when it executes it: calls run in order, so a commit's result is
known before the next call is sent) and the lease generation. Its other fields are the
contract call's, by the same name and type, so each is written once on the way to the
engine: the runtime's one translation (duplex_server/session/engine_calls.py) copies them
into the contract call the command's ``CALL`` names, with the fence and lease generation
filled in (tests/server/test_engine_calls.py checks the fields agree). ``epoch`` and
``event_id`` are the core's own: the epoch the call is fenced at and the client event an
error is reported against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from duplex_contract.control import (
    AppendCall,
    CloseCall,
    CommitCall,
    ItemRecord,
    ItemsCall,
    PlaybackMark,
    ReplicaCall,
    SignalCall,
    TouchCall,
)
from duplex_contract.settings import SessionUpdate
from duplex_contract.tools import ItemRef, ResponseOptions, ToolOutput
from duplex_server.protocol.codec import AudioFormat
from duplex_server.protocol.events import ServerEvent, TurnDetection
from duplex_server.protocol.session_config import EffectiveSession

#: the fields of an engine command that are the core's own, not the contract call's
CORE_FIELDS = ("epoch", "event_id")


# ---------------------------------------------------------------------------- engine calls
@dataclass(frozen=True, slots=True)
class Append:
    CALL: ClassVar[type[AppendCall]] = AppendCall
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
    CALL: ClassVar[type[CommitCall]] = CommitCall
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

    CALL: ClassVar[type[SignalCall]] = SignalCall
    epoch: int
    item: ItemRef
    event_id: str | None = None
    event: Literal["item.delete"] = "item.delete"


@dataclass(frozen=True, slots=True)
class Cancel:
    """Advance the epoch from ``epoch`` to ``epoch + 1`` (barge-in, cancel, input clear);
    the runtime adds the ``next_fence`` of that epoch."""

    CALL: ClassVar[type[SignalCall]] = SignalCall
    epoch: int
    event: Literal["barge_in", "response.cancel", "input.cancel"]
    event_id: str | None = None


@dataclass(frozen=True, slots=True)
class Discard:
    """A backchannel taken back (protocol/barge_in.py): the engine drops the input audio
    not yet committed, its speech never becomes a turn, and the epoch stays."""

    CALL: ClassVar[type[SignalCall]] = SignalCall
    epoch: int
    event_id: str | None = None
    event: Literal["input.discard"] = "input.discard"


@dataclass(frozen=True, slots=True)
class Update:
    """The session's engine settings changed: ``update`` replaces the engine's whole
    settings (``SessionUpdate.replace_with``)."""

    CALL: ClassVar[type[SignalCall]] = SignalCall
    epoch: int
    update: SessionUpdate
    event_id: str | None = None
    event: Literal["session.update"] = "session.update"


@dataclass(frozen=True, slots=True)
class Touch:
    CALL: ClassVar[type[TouchCall]] = TouchCall
    epoch: int
    activity: Literal["heartbeat", "playback_ack", "detach"]
    playback: PlaybackMark | None = None  # playback_ack: what the client played
    event_id: str | None = None


@dataclass(frozen=True, slots=True)
class CloseSession:
    """Fenced at the session's epoch when it is made (no ``epoch`` of its own)."""

    CALL: ClassVar[type[CloseCall]] = CloseCall
    reason: str
    event_id: str | None = None


@dataclass(frozen=True, slots=True)
class Speculate:
    """The VAD saw a pause inside speech (``input.pause``: transcribe ahead of the commit)
    or speech resumed (``input.resume``: drop that speculation)."""

    CALL: ClassVar[type[SignalCall]] = SignalCall
    epoch: int
    event: Literal["input.pause", "input.resume"]
    event_id: str | None = None
    respond: bool = True  # input.pause: the turn's commit will ask for a response
    traceparent: str | None = None  # input.pause: the turn's trace context (as on Commit)
    words: int | None = None  # input.pause: send the guess's words back tagged so


@dataclass(frozen=True, slots=True)
class Replicate:
    """Keep this front end's state of the session in the engine (duplex_server/session/snapshot.py),
    so another front end can take the session over (docs/scale.md). Fenced at the session's
    epoch when it is made."""

    CALL: ClassVar[type[ReplicaCall]] = ReplicaCall
    state: bytes
    event_id: str | None = None


@dataclass(frozen=True, slots=True)
class RecordItems:
    """Keep the conversation items that changed (and the front end's state of them) in the
    engine, beside the conversation, so a front end that takes the session over serves every
    item id (docs/scale.md). Fenced at the session's epoch when it is made."""

    CALL: ClassVar[type[ItemsCall]] = ItemsCall
    upserts: tuple[ItemRecord, ...] = ()
    deletes: tuple[str, ...] = ()
    state: bytes = b""
    event_id: str | None = None


EngineCommand = (
    Append
    | Commit
    | Cancel
    | Discard
    | Update
    | Touch
    | CloseSession
    | Speculate
    | DeleteItem
    | Replicate
    | RecordItems
)
#: engine commands fenced at the session's epoch when they are made (no epoch of their own)
UNFENCED = (CloseSession, Replicate, RecordItems)


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
    #: the item's audio starts again here after a pause (a resume): the runtime's encoder
    #: drops the tail it held back of the audio the far end dropped
    restart: bool = False


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
class TranscribeSpeech:
    """Transcribe the user's speech over an answer (PCM16 at the engine's input rate) and
    give its words to ``BargeIn.words`` with ``speech``: the interruption decision reads
    them (protocol/barge_in.py). Best effort: words that come late, or
    never, leave the decision to the acoustics."""

    speech: int
    pcm: bytes


@dataclass(frozen=True, slots=True)
class JudgeWords:
    """``end_of_turn: words``: judge whether ``text``, the words of the pause guess
    ``guess`` (the input up to the pause the VAD reported at ``pause_at_ms``), is a finished
    turn; the verdict goes to ``ClientInput.words_judged`` (duplex_server/session/turn_words.py)."""

    guess: int
    text: str
    eagerness: str


@dataclass(frozen=True, slots=True)
class EndTurn:
    """End the turn now at the pause the VAD reported at ``pause_at_ms``, unless speech
    came back since (the input lane decides: its ``EndTurn``)."""

    pause_at_ms: float


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
class Resync:
    """Tell the client ``session.resync_required{reason}``, numbered where its stream
    stands (the runtime knows the seq): what was running is gone."""

    reason: str


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
    | TranscribeSpeech
    | JudgeWords
    | EndTurn
    | PurgeAudio
    | AckJournal
    | CloseSocket
    | Takeover
    | Replay
    | SendStamped
    | DropOutput
    | Release
    | Resync
)
