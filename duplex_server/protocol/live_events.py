"""The GPT-Live wire (``/v1/live/sessions``): its client events, decoded strictly, and its
server events. docs/protocol.md ("GPT-Live") is normative; the event and field names are
the ones OpenAI's ``openai`` SDK (``openai.types.live``) reads and writes.

Client events are decoded once (:func:`decode_live_event`) into one of the ``Live*`` structs
below; an unknown field anywhere is refused with ``unknown_parameter`` naming its path (the
Live API's config is strict), an unknown event type with ``unknown_event``. Server events
are :class:`~duplex_server.protocol.events.ServerEvent` subclasses, so the session runtime
stamps (``event_id``), journals and sends them as it does every event; they omit defaults,
so a Live client sees no ``server_event_seq`` (the stamper leaves it 0 on Live sessions)
and no field the SDK does not name. :class:`LiveMark` is internal: it tells the Live
transport which text a piece of reply audio speaks and never reaches the wire.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import UNSET, UnsetType

from duplex_contract.validation import explain
from duplex_server.protocol.errors import ProtocolError
from duplex_server.protocol.events import ServerEvent


class _Strict(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    pass


# ============================================================================ session config
class LiveAudioFormat(_Strict, frozen=True):
    """``{type: audio/pcm, rate: 16000|24000}`` or G.711 ``audio/pcmu|pcma`` at 8000 Hz."""

    type: Literal["audio/pcm", "audio/pcmu", "audio/pcma"]
    rate: int | UnsetType = UNSET


class LiveVoiceRef(_Strict, frozen=True):
    """A custom voice by id (here: one of the engine's own voices)."""

    id: str


class LiveAudioOutput(_Strict, frozen=True):
    voice: str | LiveVoiceRef | UnsetType = UNSET


class LiveAudio(_Strict, frozen=True):
    format: LiveAudioFormat | UnsetType | None = UNSET
    output: LiveAudioOutput | UnsetType | None = UNSET


class LiveResponsesSettings(_Strict, frozen=True):
    """``delegation.responses``: the backend a responses-mode delegation runs on."""

    model: str | UnsetType = UNSET  # required at start; an update may omit it
    instructions: str | UnsetType | None = UNSET
    max_output_tokens: int | UnsetType | None = UNSET
    parallel_tool_calls: bool | UnsetType | None = UNSET
    reasoning: dict[str, Any] | UnsetType | None = UNSET
    service_tier: str | UnsetType | None = UNSET
    text: dict[str, Any] | UnsetType | None = UNSET
    tool_choice: str | dict[str, Any] | UnsetType | None = UNSET
    tools: list[dict[str, Any]] | UnsetType | None = UNSET


class _Delegation(_Strict, frozen=True, tag_field="type"):
    acknowledgement_delay_ms: int | UnsetType | None = UNSET


class ClientDelegation(_Delegation, frozen=True, tag="client"):
    """Delegated tasks go to the application (``session.delegation.created``)."""


class ResponsesDelegation(_Delegation, frozen=True, tag="responses"):
    """Delegated tasks run on a backend model call the server makes."""

    responses: LiveResponsesSettings | UnsetType = UNSET


class DecisionsDelegation(_Delegation, frozen=True, tag="decisions"):
    """The Decisions API (not supported here: refused at start)."""

    decisions: dict[str, Any] | UnsetType = UNSET


Delegation = ClientDelegation | ResponsesDelegation | DecisionsDelegation


class LiveText(_Strict, frozen=True):
    text: str
    type: Literal["input_text", "text", "output_text"] | UnsetType = UNSET


class LiveInitialItem(_Strict, frozen=True):
    """One message of the startup history (``session.input``)."""

    role: Literal["developer", "user", "assistant"]
    content: list[LiveText]
    id: str | UnsetType | None = UNSET
    status: Literal["incomplete", "completed"] | UnsetType | None = UNSET
    type: Literal["message"] | UnsetType = UNSET


class LiveSessionConfig(_Strict, frozen=True):
    """``session.start``'s ``session`` (and the ``session`` of ``POST /v1/live/sessions``)."""

    model: str
    audio: LiveAudio | UnsetType | None = UNSET
    client: dict[str, Any] | UnsetType | None = UNSET
    delegation: Delegation | UnsetType | None = UNSET
    input: list[LiveInitialItem] | UnsetType | None = UNSET
    instructions: str | UnsetType | None = UNSET
    store: bool | UnsetType | None = UNSET
    triggers: list[dict[str, Any]] | UnsetType | None = UNSET


class LiveSessionPatch(_Strict, frozen=True):
    """``session.update``'s ``session``: only the delegation settings and triggers."""

    delegation: Delegation | UnsetType | None = UNSET
    triggers: list[dict[str, Any]] | UnsetType | None = UNSET


# ============================================================================ client events
class LiveClientEvent(
    msgspec.Struct, frozen=True, tag_field="type", forbid_unknown_fields=True, kw_only=True
):
    event_id: str | None = None


class LiveSessionStart(LiveClientEvent, frozen=True, tag="session.start"):
    session: LiveSessionConfig


class LiveSessionUpdate(LiveClientEvent, frozen=True, tag="session.update"):
    session: LiveSessionPatch


class LiveAudioAppend(LiveClientEvent, frozen=True, tag="session.input_audio.append"):
    audio: str


class LiveMute(LiveClientEvent, frozen=True, tag="session.input_audio.mute"):
    pass


class LiveUnmute(LiveClientEvent, frozen=True, tag="session.input_audio.unmute"):
    pass


class LiveInstructionsAppend(LiveClientEvent, frozen=True, tag="session.instructions.append"):
    content: str
    delegation_id: str | None


class LiveThinkingAppend(LiveClientEvent, frozen=True, tag="session.thinking.append"):
    content: str
    delegation_id: str | None


class LiveCommentaryAppend(LiveClientEvent, frozen=True, tag="session.commentary.append"):
    content: str
    delegation_id: str | None


class LiveFixturePlay(LiveClientEvent, frozen=True, tag="session.output_audio.fixture.play"):
    audio: str


class LiveResponseItemCreate(LiveClientEvent, frozen=True, tag="response.item.create"):
    item: dict[str, Any]


class LiveResponseCreate(LiveClientEvent, frozen=True, tag="response.create"):
    pass


class LiveDecisionCreate(LiveClientEvent, frozen=True, tag="decision.create"):
    pass


class LiveDecisionItemCreate(LiveClientEvent, frozen=True, tag="decision.item.create"):
    item: dict[str, Any]


class LiveDecisionItemDelete(LiveClientEvent, frozen=True, tag="decision.item.delete"):
    item_id: str


class LiveSessionClose(LiveClientEvent, frozen=True, tag="session.close"):
    pass


AnyLiveClientEvent = (
    LiveSessionStart
    | LiveSessionUpdate
    | LiveAudioAppend
    | LiveMute
    | LiveUnmute
    | LiveInstructionsAppend
    | LiveThinkingAppend
    | LiveCommentaryAppend
    | LiveFixturePlay
    | LiveResponseItemCreate
    | LiveResponseCreate
    | LiveDecisionCreate
    | LiveDecisionItemCreate
    | LiveDecisionItemDelete
    | LiveSessionClose
)
#: features of the Live API this server answers with ``unsupported`` (docs/protocol.md)
UNSUPPORTED_EVENTS = (
    LiveFixturePlay,
    LiveDecisionCreate,
    LiveDecisionItemCreate,
    LiveDecisionItemDelete,
)

_DECODER = msgspec.json.Decoder(AnyLiveClientEvent)


class _Envelope(msgspec.Struct):
    type: Any = None
    event_id: Any = None


def decode_live_event(data: str | bytes) -> AnyLiveClientEvent:
    """Decode one Live client frame; raises :class:`ProtocolError` (``invalid_json``,
    ``unknown_event``, ``unknown_parameter``, ``missing_required_parameter``,
    ``invalid_value``) with the offending field as ``param``."""
    try:
        event: AnyLiveClientEvent = _DECODER.decode(data)
        return event
    except msgspec.ValidationError as exc:
        try:
            env = msgspec.json.decode(data, type=_Envelope)
        except msgspec.DecodeError:
            env = _Envelope()
        event_id = env.event_id if isinstance(env.event_id, str) else None
        problem = explain(exc, AnyLiveClientEvent)
        if isinstance(env.type, str) and problem.at == "type":
            raise ProtocolError(
                "unknown_event", f"unknown event type {env.type!r}", param="type", event_id=event_id
            ) from None
        code = {
            "unknown": "unknown_parameter",
            "missing": "missing_required_parameter",
            "invalid": "invalid_value",
        }[problem.kind]
        raise ProtocolError(
            code, problem.message, param=problem.path or None, event_id=event_id
        ) from None
    except msgspec.DecodeError as exc:
        raise ProtocolError("invalid_json", f"invalid JSON: {exc}") from None


# ============================================================================ server objects
class _Out(msgspec.Struct, frozen=True, omit_defaults=True):
    pass


class LiveFormatOut(_Out, frozen=True):
    type: str
    rate: int


class LiveAudioOutputOut(_Out, frozen=True):
    voice: str


class LiveAudioOut(_Out, frozen=True):
    format: LiveFormatOut | None = None
    output: LiveAudioOutputOut | None = None


class LiveSessionResource(msgspec.Struct, frozen=True):
    """The session as ``session.started`` / ``.updated`` / ``.closed`` carry it (every
    field written: ``status`` is required)."""

    id: str
    expires_at: int
    model: str
    status: Literal["active"] = "active"
    instructions: str | None = None
    audio: LiveAudioOut | None = None
    delegation: dict[str, Any] | None = None
    input: list[dict[str, Any]] | None = None
    store: bool = False


class LiveUsage(_Out, frozen=True):
    """Cumulative billable seconds: the session's wall-clock length so far."""

    seconds: float


class LiveContextWindow(_Out, frozen=True):
    usage_ratio: float


class LiveDelegation(_Out, frozen=True):
    id: str
    target: Literal["client", "responses"]
    type: Literal["delegation"]  # (required: a default would be omitted)
    response_id: str | None = None


class LiveErrorObj(_Out, frozen=True):
    type: str
    code: str
    message: str
    param: str | None = None
    client_event_id: str | None = None


# ============================================================================ server events
class LiveServerEvent(ServerEvent, frozen=True, omit_defaults=True, kw_only=True):
    """Base of the Live server events; ``client_event_id`` echoes the client's ``event_id``
    of the command the event answers."""

    client_event_id: str | None = None


class LiveSessionStarted(LiveServerEvent, frozen=True, tag="session.started"):
    session: LiveSessionResource
    #: extension: ``<session id>.<secret>``, for a reconnect (docs/protocol.md, "Resume")
    resume_token: str | None = None


class LiveSessionUpdated(LiveServerEvent, frozen=True, tag="session.updated"):
    session: LiveSessionResource


class LiveMuted(LiveServerEvent, frozen=True, tag="session.input_audio.muted"):
    pass


class LiveUnmuted(LiveServerEvent, frozen=True, tag="session.input_audio.unmuted"):
    pass


class LiveInstructionsAppended(LiveServerEvent, frozen=True, tag="session.instructions.appended"):
    start_ms: int
    end_ms: int


class LiveThinkingAppended(LiveServerEvent, frozen=True, tag="session.thinking.appended"):
    start_ms: int
    end_ms: int


class LiveCommentaryAppended(LiveServerEvent, frozen=True, tag="session.commentary.appended"):
    start_ms: int
    end_ms: int


class LiveInputTranscript(LiveServerEvent, frozen=True, tag="session.input_transcript.delta"):
    delta: str
    start_ms: int
    end_ms: int


class LiveOutputTranscript(LiveServerEvent, frozen=True, tag="session.output_transcript.delta"):
    delta: str
    start_ms: int
    end_ms: int


class LiveDelegationCreated(LiveServerEvent, frozen=True, tag="session.delegation.created"):
    delegation: LiveDelegation
    offset_ms: int


class LiveResponseEvent(LiveServerEvent, frozen=True, tag="response.event"):
    """A Responses streaming event of a responses-mode delegation's backend run."""

    event: dict[str, Any]
    delegation_id: str | None = None


class LiveUsageUpdated(LiveServerEvent, frozen=True, tag="session.usage.updated"):
    usage: LiveUsage
    context_window: LiveContextWindow | None = None


class LiveSessionClosed(LiveServerEvent, frozen=True, tag="session.closed"):
    reason: Literal["close_requested", "expired", "content", "remote_hangup", "connection_lost"]
    session: LiveSessionResource
    usage: LiveUsage


class LiveError(LiveServerEvent, frozen=True, tag="error"):
    error: LiveErrorObj


class LiveInfo(LiveServerEvent, frozen=True, tag="info"):
    code: str
    message: str
    #: ``code`` ``session.resumed``: the token for the next reconnect
    resume_token: str | None = None


class LiveMark(LiveServerEvent, frozen=True, tag="duplex.live_mark"):
    """Internal (never sent): the reply audio of ``item_id`` from ``start_ms`` on its audio
    clock speaks ``text`` (the TTS's mark: a clause or a chunk, not a word)."""

    item_id: str
    start_ms: float
    text: str


#: the server event types a Live client may be sent (a journal replay keeps only these)
LIVE_SERVER_TYPES = frozenset(
    {
        "session.started",
        "session.updated",
        "session.input_audio.muted",
        "session.input_audio.unmuted",
        "session.instructions.appended",
        "session.thinking.appended",
        "session.commentary.appended",
        "session.input_transcript.delta",
        "session.output_transcript.delta",
        "session.delegation.created",
        "response.event",
        "session.usage.updated",
        "session.closed",
        "error",
        "info",
    }
)


def is_live_frame(frame: bytes) -> bool:
    """Is this stamped frame a Live event a client may be sent again (a replay)? Stamped
    frames always begin with their type (msgspec writes the tag first)."""
    if not frame.startswith(b'{"type":"'):
        return False
    end = frame.find(b'"', 9)
    return end > 0 and frame[9:end].decode() in LIVE_SERVER_TYPES


def audio_delta_frame(delta_b64: str) -> str:
    """``session.output_audio.delta`` (no ``event_id``: the SDK's type has none)."""
    return '{"type":"session.output_audio.delta","delta":"' + delta_b64 + '"}'
