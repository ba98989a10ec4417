"""The engine's own messages: stage requests and outputs, and the queue envelopes.

What the server side also uses is defined in :mod:`duplex_contract` and imported from
there by every user (no name is re-exported here): control calls and their result
(:mod:`duplex_contract.control`), batch jobs and their items, which include the stages'
text, audio and transcript outputs (:mod:`duplex_contract.batch`), session events and
errors in transit (:mod:`duplex_contract.session_events`).

Every message is a msgspec struct with a type tag; unknown fields are refused when a
message is decoded (``decode``), and errors travel as :class:`ErrorInfo`, re-raised on the
receiving side. Nothing here is a ``dict[str, Any]``.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Literal

import msgspec

from duplex_contract.audio import INPUT_RATE, OUTPUT_RATE
from duplex_contract.batch import (
    AudioOut,
    BatchItem,
    BatchJob,
    ChatMessage,
    TextOut,
    TranscriptOut,
)
from duplex_contract.control import ControlCall
from duplex_contract.session_events import ErrorInfo, Msg, SessionEvent
from duplex_contract.settings import Tool


class Priority(IntEnum):
    """Lower runs first: real-time work is scheduled ahead of batch work.

    ``DRAFT``: a session's answer to a pause, made before its turn commits and held
    (engine/orchestration/drafts.py): behind every other session's real-time work, but ahead
    of everything else, so a session's own draft is its most urgent work while no real-time
    request waits. Once the turn adopts it, its later requests are ``REALTIME``.

    ``SPECULATIVE``: real-time work that may be thrown away (an ASR guess at a pause in the
    user's speech, engine/orchestration/speculation.py): it runs when no committed turn's work
    waits, so on a loaded stage the guesses never delay a turn (they are admitted like real-time
    work, not held back like batch requests)."""

    REALTIME = 0
    DRAFT = 1
    SPECULATIVE = 2
    BATCH = 3


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
    # The speech may be a listener's hum over an answer (its words judge an interruption): an
    # ASR that can tell writes a hum it took for words as one (Whisper: whisper_decoder.HUMS).
    hums: bool = False


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
    #: only bring ``messages`` (rendered without the assistant's turn) into the backend's
    #: prompt cache, and answer ``StageDone``: a later request whose prompt starts with them
    #: evaluates only the rest (sent only to a backend whose ``warms_prompts`` is true)
    prefill_only: bool = False


class TtsRequest(Msg, frozen=True, tag="tts"):
    request_id: str
    text: str
    voice: str | None = None
    speed: float = 1.0
    sample_rate: int = OUTPUT_RATE
    priority: Priority = Priority.REALTIME
    session_id: str | None = None
    #: the first clause of a response's speech: its first audio waits on it
    #: (engine/stages/compute.py)
    first: bool = False


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
