"""Typed messages that cross the engine's boundaries (janus queues, stage workers).

What the server side also needs (fences, session events, errors in transit, session
settings) is defined in :mod:`duplex_contract` and re-exported here.

Every message is a msgspec struct with a type tag; unknown fields are refused when a
message is decoded (``decode``), and errors travel as :class:`ErrorInfo`, re-raised on the
receiving side. Nothing here is a ``dict[str, Any]``.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Literal

import msgspec

from duplex_contract.audio import INPUT_RATE, OUTPUT_RATE
from duplex_contract.events import AudioChunk as AudioChunk
from duplex_contract.events import ErrorInfo as ErrorInfo
from duplex_contract.events import Msg as Msg
from duplex_contract.events import ResponseDone as ResponseDone
from duplex_contract.events import ResponseStarted as ResponseStarted
from duplex_contract.events import ResponseStatus as ResponseStatus
from duplex_contract.events import SessionEvent as SessionEvent
from duplex_contract.events import SessionLifecycle as SessionLifecycle
from duplex_contract.events import TextDelta as TextDelta
from duplex_contract.events import UserTranscript as UserTranscript
from duplex_contract.fence import Fence as Fence
from duplex_contract.settings import Modality as Modality
from duplex_contract.settings import SessionSettings as SessionSettings
from duplex_contract.settings import SessionUpdate as SessionUpdate
from duplex_contract.settings import Tool as Tool
from duplex_contract.settings import ToolChoice as ToolChoice
from duplex_contract.tools import ItemRef as ItemRef
from duplex_contract.tools import ResponseOptions as ResponseOptions
from duplex_contract.tools import ToolOutput as ToolOutput


class Priority(IntEnum):
    """Lower runs first: real-time work is scheduled ahead of batch work.

    ``SPECULATIVE``: real-time work that may be thrown away (an ASR guess at a pause in the
    user's speech, engine/speculation.py): it runs when no committed turn's work waits, so
    on a loaded stage the guesses never delay a turn (they are admitted like real-time
    work, not held back like batch requests)."""

    REALTIME = 0
    SPECULATIVE = 1
    BATCH = 2


# ----------------------------------------------------------------------------- chat
class ChatMessage(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    role: Literal["system", "user", "assistant"]
    content: str


# ----------------------------------------------------------------------------- stage I/O
class AsrRequest(Msg, frozen=True, tag="asr"):
    request_id: str
    audio: bytes  # PCM16 mono, little endian
    sample_rate: int = INPUT_RATE
    language: str = "en"
    priority: Priority = Priority.REALTIME
    session_id: str | None = None
    # The same speaker's previous turn (PCM16 at ``sample_rate``, and its transcript): an
    # ASR that can use context decodes this turn after it, as the batch route decodes a
    # whole recording, so a short turn ("Ever failed.") keeps its neighbours' context.
    context_audio: bytes = b""
    context_text: str = ""
    # Seconds of silence between the end of the context's turn (its commit) and the start of
    # this turn's audio, by the engine's clock: a long gap (the assistant answered, or the
    # user paused) means a new utterance, which the ASR decodes alone.
    context_gap_s: float = 0.0


class LlmRequest(Msg, frozen=True, tag="llm"):
    """``tools`` (if any) may be called: under ``tool_required`` the output must be one call
    ``{"name", "arguments"}`` of them, else it is either plain text (not starting with
    ``{``) or one call. Backends constrain their decoding to that (duplex_contract.tools)."""

    request_id: str
    messages: tuple[ChatMessage, ...]
    max_tokens: int = 128
    temperature: float = 0.0
    priority: Priority = Priority.REALTIME
    session_id: str | None = None
    tools: tuple[Tool, ...] = ()
    tool_required: bool = False


class TtsRequest(Msg, frozen=True, tag="tts"):
    request_id: str
    text: str
    voice: str | None = None
    speed: float = 1.0
    sample_rate: int = OUTPUT_RATE
    priority: Priority = Priority.REALTIME
    session_id: str | None = None


class TokensRequest(Msg, frozen=True, tag="tokens"):
    """A window of token ids or codec codes for a stage that consumes ``tokens``/``codec``.

    The first ``context`` entries are left context only (already decoded by the previous
    window): the stage uses them for continuity and emits output for the rest.
    """

    request_id: str
    ids: tuple[int, ...]
    context: int = 0
    final: bool = False  # the last window of its upstream request
    sample_rate: int = OUTPUT_RATE
    voice: str | None = None
    priority: Priority = Priority.REALTIME
    session_id: str | None = None


StageRequest = AsrRequest | LlmRequest | TtsRequest | TokensRequest


class TranscriptOut(Msg, frozen=True, tag="transcript"):
    request_id: str
    text: str
    final: bool


class TextOut(Msg, frozen=True, tag="text"):
    request_id: str
    text: str


class AudioOut(Msg, frozen=True, tag="audio"):
    """A PCM16 mono chunk (~100 ms). ``t_ns`` = time.monotonic_ns() when the stage made it."""

    request_id: str
    pcm: bytes
    sample_rate: int
    t_ns: int = 0
    text: str = (
        ""  # optional mark: the characters this chunk speaks (else the orchestrator sets it)
    )


class TokensOut(Msg, frozen=True, tag="token_ids"):
    """Token ids (edge ``tokens``) or codec codes (edge ``codec``) as they are sampled."""

    request_id: str
    ids: tuple[int, ...]


class StageDone(Msg, frozen=True, tag="done"):
    request_id: str
    finish_reason: Literal["stop", "length", "aborted"] = "stop"
    tokens: int = 0
    prompt_tokens: int = 0


StageOutput = TranscriptOut | TextOut | AudioOut | TokensOut | StageDone


# ----------------------------------------------------------------------------- sessions
#: the settings a session opens with (the contract's one settings struct).
SessionConfig = SessionSettings


class OpenCall(Msg, frozen=True, tag="open"):
    config: SessionConfig = SessionConfig()
    route_key: str | None = None  # the opening front end's; carried in the session id
    traceparent: str | None = None  # W3C trace context of the session's span (engine/tracing.py)


class AppendCall(Msg, frozen=True, tag="append"):
    fence: Fence
    lease_generation: int
    audio: bytes = b""  # PCM16 mono at ``sample_rate``
    text: str | None = None
    sample_rate: int = INPUT_RATE  # the engine refuses any other rate
    seq: int | None = None  # client append sequence: a resend after reconnect never duplicates
    operation_id: str | None = None
    expected_epoch: int | None = None
    item_id: str | None = None  # the client's item this text belongs to
    tool_output: ToolOutput | None = None  # a function_call_output item
    #: where ``audio`` starts on the session's input clock (ms of input the front end has
    #: processed, silence included): the engine times the pause between two turns in audio,
    #: not wall-clock, time (engine/speculation.py). None: not known (wall clock instead).
    stream_ms: float | None = None


class CommitCall(Msg, frozen=True, tag="commit"):
    fence: Fence
    lease_generation: int
    respond: bool = True
    operation_id: str | None = None
    item_id: str | None = None  # the user audio item this commit closes
    response: ResponseOptions | None = None  # overrides of the response (if respond)
    traceparent: str | None = None  # W3C trace context of the turn's span (engine/tracing.py)


SignalEvent = Literal[
    "barge_in",
    "response.cancel",
    "input.cancel",
    "session.update",
    # The VAD saw a pause begin: transcribe the input so far speculatively; a commit that
    # follows (with only silence appended since) uses that transcript.
    "input.pause",
    # The user resumed speaking: drop the speculation.
    "input.resume",
    # conversation.item.delete: drop ``item`` from the history
    "item.delete",
]


class SignalCall(Msg, frozen=True, tag="signal"):
    fence: Fence
    lease_generation: int
    event: SignalEvent
    next_fence: Fence | None = None
    update: SessionUpdate | None = None
    operation_id: str | None = None
    item: ItemRef | None = None  # item.delete
    # input.pause: the commit that may follow will ask for a response (so the engine may
    # answer the pause ahead of it: engine/drafts.py)
    respond: bool = True
    # input.pause: W3C trace context of the turn's span (engine/tracing.py)
    traceparent: str | None = None


class PlaybackMark(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What the client actually played of one response (truncates its assistant turn)."""

    turn_id: int
    response_seq: int
    played_ms: float
    # False: progress report (kept; applied if the response is cancelled or already done).
    # True: cut the assistant turn now (``conversation.item.truncate``).
    truncate: bool = False


Activity = Literal["heartbeat", "detach", "attach", "playback_ack"]


class TouchCall(Msg, frozen=True, tag="touch"):
    fence: Fence
    lease_generation: int
    activity: Activity
    playback: PlaybackMark | None = None


class ResumeCall(Msg, frozen=True, tag="resume"):
    session_id: str
    expected_lease_generation: int
    #: look only: the current lease generation, the front end's replica and the engine's
    #: input seq, nothing changed (a front end that does not know the session asks first)
    peek: bool = False


class ReplicaCall(Msg, frozen=True, tag="replica"):
    """The owning front end's state of a session (an opaque blob it can rebuild the session
    from on any front end: engine/duplex/replica.py); the engine keeps the latest one."""

    fence: Fence
    lease_generation: int
    state: bytes


class CloseCall(Msg, frozen=True, tag="close"):
    fence: Fence
    lease_generation: int
    reason: str = "client"


ControlCall = (
    OpenCall
    | AppendCall
    | CommitCall
    | SignalCall
    | TouchCall
    | ResumeCall
    | CloseCall
    | ReplicaCall
)


class ControlResult(Msg, frozen=True, tag="result"):
    """``ok=False`` is authoritative: the call changed nothing."""

    control_id: int
    ok: bool
    session_id: str | None = None
    accepted_fence: Fence | None = None
    lease_generation: int = 0
    error: ErrorInfo | None = None
    clamped_ms: float | None = None  # playback_ack: the played duration actually applied
    deduplicated: bool = False
    replica: bytes | None = None  # resume: the front end's replica of the session
    input_seq: int | None = None  # resume: the newest client input seq the engine has


# ----------------------------------------------------------------------------- batch jobs
class SpeechJob(Msg, frozen=True, tag="speech"):
    text: str
    voice: str | None = None
    speed: float = 1.0
    sample_rate: int = OUTPUT_RATE


class ChatJob(Msg, frozen=True, tag="chat"):
    messages: tuple[ChatMessage, ...]
    max_tokens: int = 256
    temperature: float = 0.0
    audio: bool = False
    voice: str | None = None
    sample_rate: int = OUTPUT_RATE


class TranscribeJob(Msg, frozen=True, tag="transcribe"):
    audio: bytes  # PCM16 mono
    sample_rate: int = INPUT_RATE
    language: str = "en"


BatchJob = SpeechJob | ChatJob | TranscribeJob


class BatchDone(Msg, frozen=True, tag="batch_done"):
    request_id: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    audio_ms: float = 0.0
    finish_reason: str = "stop"


BatchItem = TextOut | AudioOut | TranscriptOut | BatchDone


# ----------------------------------------------------------------------------- queue envelopes
class ControlRequest(Msg, frozen=True, tag="control"):
    control_id: int
    call: ControlCall


class GenerateRequest(Msg, frozen=True, tag="generate"):
    request_id: str
    job: BatchJob


class AbortRequest(Msg, frozen=True, tag="abort"):
    request_id: str


class ShutdownRequest(Msg, frozen=True, tag="shutdown"):
    pass


class DetachRequest(Msg, frozen=True, tag="detach_sessions"):
    """The front end that drove these sessions is gone: detach them (their leases run the
    disconnect grace period, then expire and free their slots). Sent by an engine process."""

    session_ids: tuple[str, ...]


EngineRequest = ControlRequest | GenerateRequest | AbortRequest | ShutdownRequest | DetachRequest


class SessionOutput(Msg, frozen=True, tag="session_output"):
    session_id: str
    event: SessionEvent


class BatchOutput(Msg, frozen=True, tag="batch_output"):
    request_id: str
    item: BatchItem | None = None
    error: ErrorInfo | None = None


class EngineFatal(Msg, frozen=True, tag="fatal"):
    error: ErrorInfo


EngineOutput = SessionOutput | BatchOutput | EngineFatal

_ENGINE_REQUEST_DECODER = msgspec.msgpack.Decoder(EngineRequest)


def encode(msg: Msg) -> bytes:
    """Encode for a process boundary (msgpack)."""
    return msgspec.msgpack.encode(msg)


def decode_request(data: bytes) -> EngineRequest:
    """Decode an engine request; unknown fields or tags raise msgspec.ValidationError."""
    request: EngineRequest = _ENGINE_REQUEST_DECODER.decode(data)
    return request
