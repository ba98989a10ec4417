"""Typed wire events (OpenAI Realtime GA names plus duplex extensions). docs/protocol.md is
normative; this module is its code.

Client events are decoded once at the edge (:mod:`duplex_server.protocol.codec`) into one of
the ``Client*`` structs below; unknown fields are refused. Server events are ``Server*``
structs; ``event_id`` and ``server_event_seq`` are stamped when the event is sent.

It is over 600 lines on purpose: it is the schema, one flat list of structs that mirrors
docs/protocol.md section by section, and splitting it would only scatter that mirror.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, UnsetType

Modality = Literal["text", "audio"]
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PosInt = Annotated[int, msgspec.Meta(ge=1)]


class _Strict(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    pass


# ============================================================================ session objects
class AudioFormatObj(_Strict, frozen=True):
    """GA format object: ``audio/pcm`` (rate 16000 or 24000), ``audio/pcmu``, ``audio/pcma``."""

    type: Literal["audio/pcm", "audio/pcmu", "audio/pcma"] = "audio/pcm"
    rate: int | UnsetType = UNSET


#: Beta flat format names; ``pcm16`` is 24 kHz, ``pcm16_16k`` is our extension.
BetaFormat = Literal["pcm16", "pcm16_16k", "g711_ulaw", "g711_alaw"]
AudioFormatParam = AudioFormatObj | BetaFormat


class TurnDetectionParam(_Strict, frozen=True):
    type: Literal["server_vad", "semantic_vad"] = "server_vad"
    threshold: float | UnsetType = UNSET
    prefix_padding_ms: int | UnsetType = UNSET
    silence_duration_ms: int | UnsetType = UNSET
    create_response: bool | UnsetType = UNSET
    interrupt_response: bool | UnsetType = UNSET
    idle_timeout_ms: int | UnsetType | None = UNSET
    eagerness: str | UnsetType = UNSET  # semantic_vad: low, medium, high, auto
    # duplex extension, semantic_vad: what judges a pause (the audio: Smart Turn; the words)
    end_of_turn: Literal["audio", "words"] | UnsetType = UNSET
    # duplex extensions: false barge-in guards
    min_interrupt_speech_ms: int | UnsetType = UNSET
    uninterruptible_ms: int | UnsetType = UNSET
    # duplex extensions: the interruption decision (duplex_server/protocol/interruption.py)
    interrupt_mode: Literal["auto", "immediate", "confirm"] | UnsetType = UNSET
    confirm_window_ms: int | UnsetType = UNSET
    backchannels: list[str] | UnsetType | None = UNSET


class NoiseReductionParam(_Strict, frozen=True):
    type: Literal["near_field", "far_field"]


class TranscriptionParam(_Strict, frozen=True):
    """``audio.input.transcription``: ``language`` (ISO-639-1) is the language the user's
    speech is transcribed in; ``model`` and ``prompt`` are accepted (the engine's ASR stage
    is the server's own)."""

    model: str | UnsetType = UNSET
    language: str | UnsetType | None = UNSET
    prompt: str | UnsetType = UNSET


class AudioInputParam(_Strict, frozen=True):
    format: AudioFormatParam | UnsetType = UNSET
    # the engine's ASR always transcribes (null is accepted and changes nothing)
    transcription: TranscriptionParam | UnsetType | None = UNSET
    noise_reduction: NoiseReductionParam | UnsetType | None = UNSET
    turn_detection: TurnDetectionParam | UnsetType | None = UNSET
    # duplex extension: cancel the server's own output from the input (media transports)
    echo_cancellation: bool | UnsetType | None = UNSET
    # duplex extension: keypad digits (phone transports) become user text items
    dtmf_as_text: bool | UnsetType = UNSET


class AudioOutputParam(_Strict, frozen=True):
    format: AudioFormatParam | UnsetType = UNSET
    voice: str | UnsetType = UNSET
    speed: float | UnsetType = UNSET


class AudioParam(_Strict, frozen=True):
    input: AudioInputParam | UnsetType = UNSET
    output: AudioOutputParam | UnsetType = UNSET


class ToolParam(_Strict, frozen=True):
    """A function the model may call (``parameters``: a JSON Schema object)."""

    name: str
    type: Literal["function"] = "function"
    description: str | UnsetType = UNSET
    parameters: dict[str, Any] | UnsetType = UNSET


class ToolChoiceFunction(_Strict, frozen=True):
    name: str
    type: Literal["function"] = "function"


ToolChoiceParam = Literal["auto", "none", "required"] | ToolChoiceFunction


class SessionParam(_Strict, frozen=True):
    """A partial session (``session.update``): omitted fields stay as they are.

    GA nested fields and beta flat fields are both accepted; the GA field wins if both are
    given. Fields marked "accepted" are validated for type only and have no effect.
    """

    type: Literal["realtime", "transcription"] | UnsetType = UNSET
    model: str | UnsetType = UNSET
    instructions: str | UnsetType = UNSET
    output_modalities: list[Modality] | UnsetType = UNSET
    audio: AudioParam | UnsetType = UNSET
    max_output_tokens: int | Literal["inf"] | UnsetType = UNSET
    temperature: float | UnsetType = UNSET
    tools: list[ToolParam] | UnsetType = UNSET
    tool_choice: ToolChoiceParam | UnsetType = UNSET
    parallel_tool_calls: bool | UnsetType = UNSET  # accepted
    tracing: Any = UNSET  # accepted
    truncation: Any = UNSET  # accepted
    prompt: Any = UNSET  # accepted
    include: list[str] | UnsetType = UNSET  # accepted
    reasoning: Any = UNSET  # accepted
    # beta flat spellings
    modalities: list[Modality] | UnsetType = UNSET
    voice: str | UnsetType = UNSET
    speed: float | UnsetType = UNSET
    input_audio_format: BetaFormat | UnsetType = UNSET
    output_audio_format: BetaFormat | UnsetType = UNSET
    turn_detection: TurnDetectionParam | UnsetType | None = UNSET
    input_audio_transcription: TranscriptionParam | UnsetType | None = UNSET
    input_audio_noise_reduction: NoiseReductionParam | UnsetType | None = UNSET
    max_response_output_tokens: int | Literal["inf"] | UnsetType = UNSET
    # duplex extension: event names this session's server events use
    event_names: Literal["ga", "beta"] | UnsetType = UNSET


class ContentPartParam(_Strict, frozen=True):
    type: Literal["input_text", "input_audio", "text", "output_text", "audio", "output_audio"]
    text: str | UnsetType = UNSET
    audio: str | UnsetType = UNSET
    transcript: str | UnsetType | None = UNSET


class ItemParam(_Strict, frozen=True):
    """A message, or a function's result (``function_call_output{call_id, output}``)."""

    type: Literal["message", "function_call", "function_call_output", "item_reference"] = "message"
    role: Literal["user", "system", "assistant"] = "user"
    content: list[ContentPartParam] = []
    id: str | UnsetType = UNSET
    object: Literal["realtime.item"] | UnsetType = UNSET
    status: str | UnsetType = UNSET
    call_id: str | UnsetType = UNSET
    output: str | UnsetType = UNSET
    name: str | UnsetType = UNSET
    arguments: str | UnsetType = UNSET


class ResponseParam(_Strict, frozen=True):
    conversation: Literal["auto", "none"] | str | UnsetType = UNSET
    instructions: str | UnsetType = UNSET
    output_modalities: list[Modality] | UnsetType = UNSET
    modalities: list[Modality] | UnsetType = UNSET  # beta
    audio: AudioParam | UnsetType = UNSET
    voice: str | UnsetType = UNSET  # beta
    output_audio_format: BetaFormat | UnsetType = UNSET  # beta
    max_output_tokens: int | Literal["inf"] | UnsetType = UNSET
    max_response_output_tokens: int | Literal["inf"] | UnsetType = UNSET  # beta
    temperature: float | UnsetType = UNSET
    metadata: dict[str, str] | UnsetType | None = UNSET
    input: list[ItemParam] | UnsetType = UNSET  # the prompt of an out-of-band response
    tools: list[ToolParam] | UnsetType = UNSET
    tool_choice: ToolChoiceParam | UnsetType = UNSET
    prompt: Any = UNSET  # accepted


# ============================================================================ client events
class ClientEvent(
    msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="type", kw_only=True
):
    event_id: str | None = None


class SessionUpdate(ClientEvent, frozen=True, tag="session.update"):
    session: SessionParam


class InputAudioBufferAppend(ClientEvent, frozen=True, tag="input_audio_buffer.append"):
    audio: str
    input_seq: PosInt | None = None  # extension: input exactly once (§ Input exactly once)


class InputAudioBufferCommit(ClientEvent, frozen=True, tag="input_audio_buffer.commit"):
    pass


class InputAudioBufferClear(ClientEvent, frozen=True, tag="input_audio_buffer.clear"):
    pass


class ConversationItemCreate(ClientEvent, frozen=True, tag="conversation.item.create"):
    item: ItemParam
    previous_item_id: str | None = None
    input_seq: PosInt | None = None  # extension: input exactly once (§ Input exactly once)


class ConversationItemDelete(ClientEvent, frozen=True, tag="conversation.item.delete"):
    item_id: str


class ConversationItemRetrieve(ClientEvent, frozen=True, tag="conversation.item.retrieve"):
    item_id: str


class ConversationItemTruncate(ClientEvent, frozen=True, tag="conversation.item.truncate"):
    item_id: str
    audio_end_ms: NonNegInt
    content_index: int = 0


class ResponseCreate(ClientEvent, frozen=True, tag="response.create"):
    response: ResponseParam | None = None


class ResponseCancel(ClientEvent, frozen=True, tag="response.cancel"):
    response_id: str | None = None


class OutputAudioBufferClear(ClientEvent, frozen=True, tag="output_audio_buffer.clear"):
    pass


class SessionHeartbeat(ClientEvent, frozen=True, tag="session.heartbeat"):
    pass


class SessionEventAck(ClientEvent, frozen=True, tag="session.event_ack"):
    seq: NonNegInt


class SessionResume(ClientEvent, frozen=True, tag="session.resume"):
    session_id: str
    resume_token: str
    last_received_server_event_seq: NonNegInt = 0


class SessionClose(ClientEvent, frozen=True, tag="session.close"):
    pass


class PlaybackAck(ClientEvent, frozen=True, tag="playback.ack"):
    item_id: str
    played_ms: Annotated[float, msgspec.Meta(ge=0)]


class BargeIn(ClientEvent, frozen=True, tag="barge_in"):
    pass


# ============================================================================ server objects
class ErrorDetail(msgspec.Struct, frozen=True):
    type: str
    code: str
    message: str
    param: str | None = None
    event_id: str | None = None


class AudioFormatOut(msgspec.Struct, frozen=True):
    type: Literal["audio/pcm", "audio/pcmu", "audio/pcma"]
    rate: int


class TurnDetection(msgspec.Struct, frozen=True):
    """The effective server VAD settings (defaults are docs/protocol.md's)."""

    type: Literal["server_vad", "semantic_vad"] = "server_vad"
    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    create_response: bool = True
    interrupt_response: bool = True
    idle_timeout_ms: int | None = None
    min_interrupt_speech_ms: int = 120
    uninterruptible_ms: int = 0
    #: how speech over an answer is judged (protocol/interruption.py): ``auto`` is
    #: ``confirm`` where the server plays the audio (a media transport), else ``immediate``
    interrupt_mode: Literal["auto", "immediate", "confirm"] = "auto"
    #: confirm: speech that goes on this long (from its onset) stops the answer
    confirm_window_ms: int = 800
    #: confirm: what a listener says that never stops the answer (None: the default list,
    #: interruption.DEFAULT_BACKCHANNELS)
    backchannels: tuple[str, ...] | None = None
    #: semantic_vad only (null for server_vad): how soon a turn that sounds finished ends
    eagerness: Literal["low", "medium", "high", "auto"] | None = None
    #: semantic_vad only (null for server_vad): what judges a pause: ``audio`` (Smart Turn
    #: on the turn's audio) or ``words`` (the pause guess's transcript, judged by a small
    #: language model: duplex_server/session/turn_words.py)
    end_of_turn: Literal["audio", "words"] | None = None


class NoiseReductionOut(msgspec.Struct, frozen=True):
    type: Literal["near_field", "far_field"]


class TranscriptionOut(msgspec.Struct, frozen=True):
    """The user's speech is transcribed in ``language`` (ISO-639-1)."""

    language: str


class AudioInputOut(msgspec.Struct, frozen=True):
    format: AudioFormatOut
    turn_detection: TurnDetection | None
    transcription: TranscriptionOut | None = None
    noise_reduction: NoiseReductionOut | None = None
    echo_cancellation: bool = False
    dtmf_as_text: bool = False


class AudioOutputOut(msgspec.Struct, frozen=True):
    format: AudioFormatOut
    voice: str | None
    speed: float = 1.0


class AudioConfigOut(msgspec.Struct, frozen=True):
    input: AudioInputOut
    output: AudioOutputOut


class ToolObj(msgspec.Struct, frozen=True):
    name: str
    description: str
    parameters: dict[str, Any]
    type: Literal["function"] = "function"


class ToolChoiceObj(msgspec.Struct, frozen=True):
    name: str
    type: Literal["function"] = "function"


class SessionObj(msgspec.Struct, frozen=True):
    """The full effective session (``session.created`` / ``session.updated``)."""

    id: str
    model: str
    instructions: str
    output_modalities: list[Modality]
    audio: AudioConfigOut
    max_output_tokens: int | Literal["inf"]
    event_names: Literal["ga", "beta"]
    type: Literal["realtime", "transcription"] = "realtime"
    object: Literal["realtime.session"] = "realtime.session"
    tools: list[ToolObj] = []
    tool_choice: str | ToolChoiceObj = "auto"
    temperature: float | None = None


class Capabilities(msgspec.Struct, frozen=True):
    supports_barge_in: bool
    supports_session_resume: bool
    input_audio_formats: list[str]
    output_audio_formats: list[str]
    turn_detection: list[str]
    vad_backend: str
    max_frame_bytes: int
    journal_max_bytes: int
    journal_max_age_s: float
    protocol_version: int = 1


class ContentPart(msgspec.Struct, frozen=True, omit_defaults=True):
    type: Literal["input_text", "input_audio", "output_text", "output_audio"]
    text: str | None = None
    transcript: str | None = None


class Item(msgspec.Struct, frozen=True, tag_field="type", tag="message"):
    id: str
    role: Literal["user", "assistant", "system"]
    content: list[ContentPart]
    status: Literal["completed", "in_progress", "incomplete"] = "completed"
    object: Literal["realtime.item"] = "realtime.item"


class FunctionCallItem(msgspec.Struct, frozen=True, tag_field="type", tag="function_call"):
    """A call the model made; ``arguments`` is JSON text that matches the tool's schema."""

    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["completed", "in_progress", "incomplete"] = "completed"
    object: Literal["realtime.item"] = "realtime.item"


class FunctionCallOutputItem(
    msgspec.Struct, frozen=True, tag_field="type", tag="function_call_output"
):
    id: str
    call_id: str
    output: str
    status: Literal["completed", "in_progress", "incomplete"] = "completed"
    object: Literal["realtime.item"] = "realtime.item"


AnyItem = Item | FunctionCallItem | FunctionCallOutputItem


class StatusDetails(msgspec.Struct, frozen=True, omit_defaults=True):
    type: Literal["completed", "cancelled", "incomplete", "failed"]
    reason: str | None = None
    error: ErrorDetail | None = None


class InputTokenDetails(msgspec.Struct, frozen=True):
    text_tokens: int = 0
    audio_tokens: int = 0
    cached_tokens: int = 0


class OutputTokenDetails(msgspec.Struct, frozen=True):
    text_tokens: int = 0
    audio_tokens: int = 0


class Usage(msgspec.Struct, frozen=True):
    """What a response used (OpenAI's shape; docs/protocol.md §5.11 says how it is counted).

    ``input_audio_seconds`` and ``output_audio_seconds`` are duplex extensions: the user
    audio the response answered and the audio it spoke."""

    total_tokens: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    input_token_details: InputTokenDetails = InputTokenDetails()
    output_token_details: OutputTokenDetails = OutputTokenDetails()
    input_audio_seconds: float = 0.0
    output_audio_seconds: float = 0.0


class SessionUsage(Usage, frozen=True):
    """A session's usage so far (``session.closed``, extension): its responses' usage
    summed, except ``input_audio_seconds``, which counts all the audio the session received
    (answered or not)."""

    responses: int = 0


class ResponseTiming(msgspec.Struct, frozen=True):
    """Where the time of one response went (a duplex extension on ``response.done``).

    ``moments_ms``: server moments in ms relative to the user's last voiced audio
    (``last_voice``, estimated from the VAD's ``audio_end_ms`` and the input clock; absent
    for a turn without server VAD, then relative to ``committed``): ``speech_started``,
    ``speech_stopped``, ``committed``, ``transcript_ready``, ``response_created``,
    ``first_audio`` (the engine's first audio chunk reached the session) and
    ``first_audio_sent`` (its delta written to the socket). ``segments_ms``: ``silence_wait``
    (last voice -> speech_stopped), ``asr`` (speech_stopped or commit -> transcript),
    ``llm`` (prompt -> first token), ``tts`` (first token -> first audio chunk, the first
    clause's words included), ``send`` (first audio -> written), ``server_total`` (last
    voice or commit -> first audio written). Missing moments are omitted.
    """

    moments_ms: dict[str, float]
    segments_ms: dict[str, float]


class ResponseObj(msgspec.Struct, frozen=True):
    id: str
    status: Literal["in_progress", "completed", "cancelled", "incomplete", "failed"]
    output: list[AnyItem]
    output_modalities: list[Modality]
    status_details: StatusDetails | None = None
    usage: Usage | None = None
    metadata: dict[str, str] | None = None
    conversation_id: str | None = None
    object: Literal["realtime.response"] = "realtime.response"
    # duplex extensions
    epoch: int = 0
    audio_ms: float = 0.0
    timing: ResponseTiming | None = None


# ============================================================================ server events
class ServerEvent(msgspec.Struct, frozen=True, tag_field="type", kw_only=True):
    """Base of every server event; the writer stamps ``event_id`` and ``server_event_seq``."""

    event_id: str = ""
    server_event_seq: int = 0


class SessionCreated(ServerEvent, frozen=True, tag="session.created"):
    session: SessionObj
    resume_token: str
    capabilities: Capabilities
    # extension: the query a resume socket opens with (intent=resume[&route=<key>])
    resume_query: str = "intent=resume"


class SessionUpdated(ServerEvent, frozen=True, tag="session.updated"):
    session: SessionObj


class Error(ServerEvent, frozen=True, tag="error"):
    error: ErrorDetail


class SpeechStarted(ServerEvent, frozen=True, tag="input_audio_buffer.speech_started"):
    audio_start_ms: int
    item_id: str


class SpeechStopped(ServerEvent, frozen=True, tag="input_audio_buffer.speech_stopped"):
    audio_end_ms: int
    item_id: str


class InputCommitted(ServerEvent, frozen=True, tag="input_audio_buffer.committed"):
    item_id: str
    previous_item_id: str | None = None


class InputCleared(ServerEvent, frozen=True, tag="input_audio_buffer.cleared"):
    pass


class ItemAdded(ServerEvent, frozen=True, tag="conversation.item.added"):
    item: AnyItem
    previous_item_id: str | None = None


class ItemDone(ServerEvent, frozen=True, tag="conversation.item.done"):
    item: AnyItem
    previous_item_id: str | None = None


class ItemRetrieved(ServerEvent, frozen=True, tag="conversation.item.retrieved"):
    item: AnyItem


class ItemTruncated(ServerEvent, frozen=True, tag="conversation.item.truncated"):
    item_id: str
    content_index: int
    audio_end_ms: int
    requested_audio_end_ms: int  # extension: what the client asked for (before clamping)


class ItemDeleted(ServerEvent, frozen=True, tag="conversation.item.deleted"):
    item_id: str


class InputTranscriptDelta(
    ServerEvent, frozen=True, tag="conversation.item.input_audio_transcription.delta"
):
    item_id: str
    delta: str
    content_index: int = 0


class InputTranscriptCompleted(
    ServerEvent, frozen=True, tag="conversation.item.input_audio_transcription.completed"
):
    item_id: str
    transcript: str
    content_index: int = 0


class ResponseCreated(ServerEvent, frozen=True, tag="response.created"):
    response: ResponseObj


class OutputItemAdded(ServerEvent, frozen=True, tag="response.output_item.added"):
    response_id: str
    item: AnyItem
    output_index: int = 0


class OutputItemDone(ServerEvent, frozen=True, tag="response.output_item.done"):
    response_id: str
    item: AnyItem
    output_index: int = 0


class ContentPartAdded(ServerEvent, frozen=True, tag="response.content_part.added"):
    response_id: str
    item_id: str
    part: ContentPart
    output_index: int = 0
    content_index: int = 0


class ContentPartDone(ServerEvent, frozen=True, tag="response.content_part.done"):
    response_id: str
    item_id: str
    part: ContentPart
    output_index: int = 0
    content_index: int = 0


class AudioDelta(ServerEvent, frozen=True, tag="response.output_audio.delta"):
    response_id: str
    item_id: str
    delta: str  # base64 audio in the session output format
    epoch: int
    audio_start_ms: float
    duration_ms: float
    output_index: int = 0
    content_index: int = 0


class AudioDone(ServerEvent, frozen=True, tag="response.output_audio.done"):
    response_id: str
    item_id: str
    output_index: int = 0
    content_index: int = 0


class TranscriptDelta(ServerEvent, frozen=True, tag="response.output_audio_transcript.delta"):
    response_id: str
    item_id: str
    delta: str
    output_index: int = 0
    content_index: int = 0


class TranscriptDone(ServerEvent, frozen=True, tag="response.output_audio_transcript.done"):
    response_id: str
    item_id: str
    transcript: str
    output_index: int = 0
    content_index: int = 0


class TextDelta(ServerEvent, frozen=True, tag="response.output_text.delta"):
    response_id: str
    item_id: str
    delta: str
    output_index: int = 0
    content_index: int = 0


class TextDone(ServerEvent, frozen=True, tag="response.output_text.done"):
    response_id: str
    item_id: str
    text: str
    output_index: int = 0
    content_index: int = 0


class ResponseDone(ServerEvent, frozen=True, tag="response.done"):
    response: ResponseObj


class FunctionCallArgumentsDelta(
    ServerEvent, frozen=True, tag="response.function_call_arguments.delta"
):
    response_id: str
    item_id: str
    call_id: str
    delta: str
    output_index: int = 0


class FunctionCallArgumentsDone(
    ServerEvent, frozen=True, tag="response.function_call_arguments.done"
):
    response_id: str
    item_id: str
    call_id: str
    name: str
    arguments: str
    output_index: int = 0


class DtmfEventReceived(ServerEvent, frozen=True, tag="input_audio_buffer.dtmf_event_received"):
    """A keypad digit from the phone (OpenAI's SIP event; here from Twilio ``dtmf``).

    ``event`` is the key (0-9, *, #, A-D), ``received_at`` the Unix time (s) the server got
    it; ``item_id`` (extension): the user text item it became (``dtmf_as_text``), else null.
    """

    event: str
    received_at: int
    item_id: str | None = None


class InputTimeoutTriggered(ServerEvent, frozen=True, tag="input_audio_buffer.timeout_triggered"):
    """No speech for ``idle_timeout_ms`` after the last response (turn_detection)."""

    audio_start_ms: int
    audio_end_ms: int
    item_id: str


class OutputAudioCleared(ServerEvent, frozen=True, tag="output_audio_buffer.cleared"):
    response_id: str | None = None


class OutputAudioPaused(ServerEvent, frozen=True, tag="output_audio_buffer.paused"):
    """Extension (``interrupt_mode: confirm``): speech over the answer may be an
    interruption; its audio is paused (a client that plays it pauses its player) until
    ``output_audio_buffer.resumed`` or ``.cleared`` says what it was."""

    response_id: str
    item_id: str


class OutputAudioResumed(ServerEvent, frozen=True, tag="output_audio_buffer.resumed"):
    """Extension: the speech that paused the answer was not an interruption (a listener's
    "mm-hm", a noise): the answer goes on from where it stopped, nothing repeated or lost
    (``audio_start_ms``: where on the item's audio clock, when the server plays it)."""

    response_id: str
    item_id: str
    audio_start_ms: float | None = None


class OutputAudioStarted(ServerEvent, frozen=True, tag="output_audio_buffer.started"):
    """WebRTC: the server began playing a response's audio on the media track."""

    response_id: str


class OutputAudioStopped(ServerEvent, frozen=True, tag="output_audio_buffer.stopped"):
    """WebRTC: the media track played all of a response's audio."""

    response_id: str


class HeartbeatAck(ServerEvent, frozen=True, tag="session.heartbeat_ack"):
    pass


class PlaybackAcknowledged(ServerEvent, frozen=True, tag="playback.acknowledged"):
    item_id: str
    played_ms: float  # what the engine applied (clamped to audio sent)
    requested_played_ms: float


class SessionResumed(ServerEvent, frozen=True, tag="session.resumed"):
    session_id: str
    resume_token: str
    replayed: int
    lease_generation: int
    last_input_seq: int | None = None  # extension: the highest input_seq the session has


class SessionReplaced(ServerEvent, frozen=True, tag="session.replaced"):
    reason: str = "resumed on another connection"


class SessionHandover(ServerEvent, frozen=True, tag="session.handover"):
    """Extension: this front end is draining (a deploy); resume the session (same id and
    token, ``?intent=resume``): a load balancer sends it to another front end."""

    reason: str = "server_draining"


class SessionExpiring(ServerEvent, frozen=True, tag="session.expiring"):
    in_s: float
    reason: str


class SessionExpired(ServerEvent, frozen=True, tag="session.expired"):
    reason: str


class ResyncRequired(ServerEvent, frozen=True, tag="session.resync_required"):
    reason: str
    first_available_seq: int
    last_seq: int


class SessionClosed(ServerEvent, frozen=True, tag="session.closed"):
    reason: str
    usage: SessionUsage | None = None  # extension: what the session used (§5.11)


AnyClientEvent = (
    SessionUpdate
    | InputAudioBufferAppend
    | InputAudioBufferCommit
    | InputAudioBufferClear
    | ConversationItemCreate
    | ConversationItemDelete
    | ConversationItemRetrieve
    | ConversationItemTruncate
    | ResponseCreate
    | ResponseCancel
    | OutputAudioBufferClear
    | SessionHeartbeat
    | SessionEventAck
    | SessionResume
    | SessionClose
    | PlaybackAck
    | BargeIn
)

AnyServerEvent = (
    SessionCreated
    | SessionUpdated
    | Error
    | SpeechStarted
    | SpeechStopped
    | InputCommitted
    | InputCleared
    | ItemAdded
    | ItemDone
    | ItemRetrieved
    | ItemTruncated
    | ItemDeleted
    | InputTranscriptDelta
    | InputTranscriptCompleted
    | ResponseCreated
    | OutputItemAdded
    | OutputItemDone
    | ContentPartAdded
    | ContentPartDone
    | AudioDelta
    | AudioDone
    | TranscriptDelta
    | TranscriptDone
    | TextDelta
    | TextDone
    | ResponseDone
    | FunctionCallArgumentsDelta
    | FunctionCallArgumentsDone
    | InputTimeoutTriggered
    | DtmfEventReceived
    | OutputAudioCleared
    | OutputAudioPaused
    | OutputAudioResumed
    | OutputAudioStarted
    | OutputAudioStopped
    | HeartbeatAck
    | PlaybackAcknowledged
    | SessionResumed
    | SessionReplaced
    | SessionHandover
    | SessionExpiring
    | SessionExpired
    | ResyncRequired
    | SessionClosed
)

#: GA -> beta spellings of server events (``event_names: "beta"``).
BETA_NAMES: dict[str, str] = {
    "response.output_audio.delta": "response.audio.delta",
    "response.output_audio.done": "response.audio.done",
    "response.output_audio_transcript.delta": "response.audio_transcript.delta",
    "response.output_audio_transcript.done": "response.audio_transcript.done",
    "response.output_text.delta": "response.text.delta",
    "response.output_text.done": "response.text.done",
    "conversation.item.added": "conversation.item.created",
}
