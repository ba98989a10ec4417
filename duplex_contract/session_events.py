"""The session events the engine emits, and errors in transit (the protocol's wire events
are duplex_server/protocol/events.py, the SDK's public ones clients/duplex_client/events.py).

Every message is a msgspec struct with a ``type`` tag (:class:`Msg`); unknown fields are
refused when decoded. Each session event carries the :class:`~duplex_contract.fence.Fence`
of the work that produced it; output of a cancelled epoch is never delivered.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from duplex_contract.errors import EngineError, kind_of, make_error
from duplex_contract.fence import Fence


class Msg(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="type", tag=True):
    """Base of every tagged message (queue messages and session events)."""


class ErrorInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """An exception in transit. ``fatal`` means the engine is dead."""

    kind: str
    code: str
    message: str
    retryable: bool = False
    fatal: bool = False
    session_id: str | None = None
    request_id: str | None = None

    @classmethod
    def from_exc(
        cls, exc: EngineError, *, session_id: str | None = None, request_id: str | None = None
    ) -> ErrorInfo:
        kind = kind_of(exc)
        return cls(
            kind=kind,
            code=exc.code,
            message=exc.message,
            retryable=exc.retryable,
            fatal=kind == "dead",
            session_id=session_id,
            request_id=request_id,
        )

    def to_exc(self) -> EngineError:
        return make_error(
            "dead" if self.fatal else self.kind, self.code, self.message, self.retryable
        )


class UserTranscript(Msg, frozen=True, tag="user_transcript"):
    """A user turn's transcript (``final``), a live partial of the speech in progress, or
    (``guess`` set) the transcript of a pause's guess that ``input.pause`` asked back with
    ``words=guess``: the words of the input up to that pause."""

    fence: Fence
    text: str
    final: bool
    guess: int | None = None


class ResponseStarted(Msg, frozen=True, tag="response_started"):
    fence: Fence


class TextDelta(Msg, frozen=True, tag="text_delta"):
    fence: Fence
    text: str


class FunctionCallDelta(Msg, frozen=True, tag="function_call_delta"):
    """A piece of the arguments of the call ``call_id`` (the first carries ``name``)."""

    fence: Fence
    call_id: str
    name: str
    delta: str


class FunctionCallDone(Msg, frozen=True, tag="function_call_done"):
    """The call ``call_id`` is complete; ``arguments`` is JSON that matches the schema."""

    fence: Fence
    call_id: str
    name: str
    arguments: str


class AudioChunk(Msg, frozen=True, tag="audio_chunk"):
    """Audio of one response; ``text`` is the mark: the characters this chunk speaks.

    ``duration_ms`` is the chunk's length (set once, by the engine, from ``pcm``);
    ``audio_start_ms`` its offset in the response.
    """

    fence: Fence
    pcm: bytes
    sample_rate: int
    audio_start_ms: float
    duration_ms: float
    text: str = ""
    t_stage_ns: int = 0


ResponseStatus = Literal["completed", "cancelled", "failed", "incomplete"]


class ResponseDone(Msg, frozen=True, tag="response_done"):
    fence: Fence
    status: ResponseStatus
    reason: str | None = None
    text: str = ""
    audio_ms: float = 0.0
    output_tokens: int = 0
    #: the LLM's prompt tokens (instructions, history and this turn's words)
    input_tokens: int = 0
    error: ErrorInfo | None = None
    #: engine-side segments of this response in ms (``asr_wait``: the turn's transcript
    #: awaited after the job started; ``llm_first_token``: prompt -> first LLM token;
    #: ``tts_first_audio``: first token -> first audio chunk, the first clause's words
    #: included). Durations, not clock readings: the engine may run in another process.
    timing_ms: dict[str, float] | None = None


class SessionLifecycle(Msg, frozen=True, tag="lifecycle"):
    """``restored``: the engine restarted and took the session back from its store
    (docs/scale.md); the conversation is kept, the answer that was running then is gone
    (``dropped``: its fence, None if none ran) and turns not answered yet are answered."""

    session_id: str
    state: Literal["expiring", "expired", "closed", "restored"]
    reason: str = ""
    in_s: float | None = None
    dropped: Fence | None = None


SessionEvent = (
    UserTranscript
    | ResponseStarted
    | TextDelta
    | FunctionCallDelta
    | FunctionCallDone
    | AudioChunk
    | ResponseDone
    | SessionLifecycle
)
