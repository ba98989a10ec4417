"""A GPT-Live session's start (sans-I/O): ``session.start``'s ``session`` (or ``POST
/v1/live/sessions``'s) checked once into a :class:`LiveStart`, and the
:class:`~duplex_server.protocol.session_config.EffectiveSession` the shared session core
runs it on (:func:`effective_session`).

What a Live session is on this engine:

* the model: ``gpt-live-1`` / ``gpt-live-1.1``, the server's own model name and any
  ``server.live.model_aliases`` are all the engine's voice route; anything else is
  ``invalid_model``;
* one audio format for both directions, fixed at start (PCM16 16/24 kHz, G.711 8 kHz;
  default PCM16 24 kHz); WebRTC negotiates its own (``audio.format`` is refused there);
* turns: the server's VAD always (``server.live.turn_detection``: ``server_vad`` or
  ``semantic_vad``), a response on every end of turn and the core's barge-in rule (the
  interruption mode goes through :func:`interruption`);
* delegation: given (``client`` or ``responses``), the thinker is offered one built-in
  function, :data:`DELEGATE_TOOL`; omitted, it is offered none (docs/protocol.md says why);
* ``input`` (startup history) is rendered into the instructions, in order.

Every problem is a :class:`ProtocolError` whose ``param`` is the field's path under
``session``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any, Literal

import msgspec
from msgspec import UnsetType

from duplex_contract.settings import Tool, ToolChoice
from duplex_contract.voices import VoiceCatalog
from duplex_server.protocol.codec import ALAW, PCM16_24K, ULAW, AudioFormat
from duplex_server.protocol.errors import ProtocolError
from duplex_server.protocol.events import ToolChoiceFunction, ToolParam, TurnDetection
from duplex_server.protocol.live_events import (
    ClientDelegation,
    DecisionsDelegation,
    LiveAudioFormat,
    LiveResponsesSettings,
    LiveSessionConfig,
    LiveVoiceRef,
    ResponsesDelegation,
)
from duplex_server.protocol.session_config import EffectiveSession, parse_tool_choice, parse_tools

_DEFAULT_TD = TurnDetection()
#: the Live models the SDK names
LIVE_MODELS = ("gpt-live-1", "gpt-live-1.1")
#: OpenAI's Live voices (``openai.types.live.BuiltInVoice``): accepted as the engine's
#: default voice unless the engine has a voice of that name
LIVE_VOICES = (
    *("alloy", "ash", "ballad", "beacon", "bossa", "cedar", "cinder", "coral", "delta"),
    *("echo", "gleam", "marin", "meridian", "quartz", "ripple", "sage", "shida", "shimmer"),
    *("stone", "tempo", "verse", "vesper", "willow"),
)
#: voices the Live API refuses (``forbidden``)
FORBIDDEN_VOICES = ("fable", "nova", "onyx")
DEFAULT_VOICE = "marin"
MAX_INPUT_ITEMS = 128
InterruptionMode = Literal["immediate", "confirm"]

#: the thinker's one built-in way to hand work off (docs/protocol.md, "Delegation")
DELEGATE_TOOL = Tool(
    name="delegate",
    description=(
        "Hand a task that needs a lookup, an action or long work to a helper. The answer "
        "comes back later; keep talking with the user meanwhile."
    ),
    parameters=json.dumps(
        {
            "type": "object",
            "properties": {"task": {"type": "string", "description": "what to do, in full"}},
            "required": ["task"],
        }
    ),
)


@dataclass(frozen=True, slots=True)
class LiveOptions:
    """The server's Live settings (``server.live``)."""

    model_aliases: tuple[str, ...] = ()
    turn_detection: TurnDetection = _DEFAULT_TD
    interruption: InterruptionMode = "confirm"
    max_session_s: float = 7200.0
    usage_interval_s: float = 5.0
    context_window_tokens: int = 8192
    backend_route: str = "text"
    backend_max_output_tokens: int = 256
    output_lead_ms: float = 200.0


@dataclass(frozen=True, slots=True)
class Backend:
    """A responses-mode delegation's backend: its prompt, tools and limits."""

    model: str
    instructions: str
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = "auto"
    tool_name: str | None = None
    max_output_tokens: int = 256


@dataclass(frozen=True, slots=True)
class LiveStart:
    """A checked ``session.start``."""

    model: str
    instructions: str  # what the thinker is told (the client's, or the server default)
    client_instructions: str | None  # as the client sent them (the session resource)
    format: AudioFormat | None  # None: WebRTC (the track's own format)
    voice: str  # as the client named it
    engine_voice: str | None  # the engine's voice (None: its default)
    target: Literal["client", "responses"] | None  # None: no delegation offered
    ack_delay_ms: int = 0
    backend: Backend | None = None
    history: tuple[tuple[str, str], ...] = ()  # (role, text) of ``input``
    delegation_wire: dict[str, Any] | None = None
    input_wire: list[dict[str, Any]] | None = None


def interruption(td: TurnDetection, mode: InterruptionMode) -> TurnDetection:
    """The turn detection a Live session runs with under interruption ``mode``.

    ``immediate`` is the core's one barge-in rule as it is (``interrupt_response``,
    ``min_interrupt_speech_ms``, ``uninterruptible_ms``). ``confirm``: an onset over the
    answer pauses it (the pacer stops sending; what it had sent plays out, at most
    ``output_lead_ms``), a backchannel or a noise takes the pause back (the answer goes on
    from the last audio sent), words that are not a backchannel stop it. The mode is
    pinned, so that the core's ``auto`` never picks for a Live session."""
    return msgspec.structs.replace(
        td, interrupt_mode=mode, interrupt_response=True, create_response=True
    )


def _format(fmt: LiveAudioFormat) -> AudioFormat:
    rate = None if isinstance(fmt.rate, UnsetType) else fmt.rate
    if fmt.type == "audio/pcm":
        rate = 24000 if rate is None else rate
        if rate not in (16000, 24000):
            raise ProtocolError(
                "invalid_value",
                f"audio/pcm rate must be 16000 or 24000, got {rate}",
                param="session.audio.format.rate",
            )
        return AudioFormat("pcm16", rate)
    if rate not in (None, 8000):
        raise ProtocolError(
            "invalid_value",
            f"{fmt.type} rate must be 8000, got {rate}",
            param="session.audio.format.rate",
        )
    return ULAW if fmt.type == "audio/pcmu" else ALAW


def _voice(voice: str | LiveVoiceRef, voices: VoiceCatalog | None) -> tuple[str, str | None]:
    """(the name for the session resource, the engine voice or None for its default)."""
    field = "session.audio.output.voice"
    if isinstance(voice, LiveVoiceRef):
        if voices is not None and voice.id not in voices.voices:
            raise ProtocolError(
                "invalid_value",
                f"unknown custom voice {voice.id!r}; {voices.describe()}",
                param=field,
            )
        return voice.id, voice.id
    if voice in FORBIDDEN_VOICES:
        raise ProtocolError("forbidden", f"voice {voice!r} is not available for Live", param=field)
    if voices is None or voice in voices.voices:
        return voice, voice
    if voice in LIVE_VOICES or voice in voices.aliases:
        return voice, None
    raise ProtocolError(
        "invalid_value",
        f"unknown voice {voice!r}; Live voices: {', '.join(LIVE_VOICES)}; {voices.describe()}",
        param=field,
    )


def parse_backend(
    cfg: LiveResponsesSettings, options: LiveOptions, base: Backend | None = None
) -> Backend:
    """``delegation.responses`` at start, or a ``session.update``'s patch of ``base`` (an
    omitted setting keeps its value)."""
    field = "session.delegation.responses"
    model = cfg.model if isinstance(cfg.model, str) else None
    if model is None and base is None:
        raise ProtocolError(
            "missing_required_parameter", "model is required", param=f"{field}.model"
        )
    if isinstance(cfg.tools, UnsetType) and base is not None:
        tools = base.tools
    else:
        tools = _function_tools(cfg.tools or [], f"{field}.tools")
    choice: ToolChoice = "auto" if base is None else base.tool_choice
    name = None if base is None else base.tool_name
    raw_choice = cfg.tool_choice
    if isinstance(raw_choice, str):
        if raw_choice not in ("auto", "none", "required"):
            raise ProtocolError(
                "invalid_value",
                "tool_choice must be auto, none, required or a function",
                param=f"{field}.tool_choice",
            )
        choice, name = raw_choice, None  # type: ignore[assignment]
    elif isinstance(raw_choice, dict):
        if raw_choice.get("type") != "function" or not isinstance(raw_choice.get("name"), str):
            raise ProtocolError(
                "unsupported",
                "tool_choice: only {type: function, name} is supported",
                param=f"{field}.tool_choice",
            )
        choice, name = parse_tool_choice(
            ToolChoiceFunction(name=raw_choice["name"]), tools, f"{field}.tool_choice"
        )
    limit = options.backend_max_output_tokens if base is None else base.max_output_tokens
    if isinstance(cfg.max_output_tokens, int):
        if cfg.max_output_tokens < 1:
            raise ProtocolError("invalid_value", "must be >= 1", param=f"{field}.max_output_tokens")
        limit = min(options.backend_max_output_tokens, cfg.max_output_tokens)
    instructions = "" if base is None else base.instructions
    if not isinstance(cfg.instructions, UnsetType):
        instructions = cfg.instructions or ""
    return Backend(model or (base.model if base else ""), instructions, tools, choice, name, limit)


def _function_tools(raw_tools: list[dict[str, Any]], field: str) -> tuple[Tool, ...]:
    params: list[ToolParam] = []
    for i, raw in enumerate(raw_tools):
        if raw.get("type") != "function":
            raise ProtocolError(
                "unsupported",
                f"tools of type {raw.get('type')!r} are not supported (function tools only)",
                param=f"{field}.{i}.type",
            )
        fields = {k: v for k, v in raw.items() if k != "strict"}
        try:
            params.append(msgspec.convert(fields, ToolParam))
        except msgspec.ValidationError as exc:
            raise ProtocolError("invalid_value", f"tool: {exc}", param=f"{field}.{i}") from None
    return parse_tools(params, field)


def _history(cfg: LiveSessionConfig) -> tuple[tuple[str, str], ...]:
    items = [] if isinstance(cfg.input, UnsetType) or cfg.input is None else cfg.input
    if len(items) > MAX_INPUT_ITEMS:
        raise ProtocolError(
            "invalid_value", f"at most {MAX_INPUT_ITEMS} input messages", param="session.input"
        )
    out: list[tuple[str, str]] = []
    for i, item in enumerate(items):
        if len(item.content) != 1:
            raise ProtocolError(
                "invalid_value",
                "each input message has exactly one text part",
                param=f"session.input.{i}.content",
            )
        out.append((item.role, item.content[0].text))
    return tuple(out)


def _refuse_unsupported(cfg: LiveSessionConfig) -> None:
    if cfg.store:
        raise ProtocolError(
            "unsupported",
            "stored sessions (fork, recordings) are not supported",
            param="session.store",
        )
    if cfg.triggers:
        raise ProtocolError(
            "unsupported", "decision triggers are not supported", param="session.triggers"
        )
    if not isinstance(cfg.client, UnsetType) and cfg.client is not None:
        raise ProtocolError(
            "unsupported",
            "data channel permissions (client) are not supported",
            param="session.client",
        )
    if isinstance(cfg.delegation, DecisionsDelegation):
        raise ProtocolError(
            "unsupported", "decisions delegation is not supported", param="session.delegation.type"
        )


def parse_start(
    cfg: LiveSessionConfig,
    *,
    options: LiveOptions,
    default_instructions: str,
    served_model: str,
    voices: VoiceCatalog | None,
    websocket: bool,
) -> LiveStart:
    """Check a Live session config; raises :class:`ProtocolError` naming the field."""
    if cfg.model not in (*LIVE_MODELS, served_model, *options.model_aliases):
        known = ", ".join((*LIVE_MODELS, served_model, *options.model_aliases))
        raise ProtocolError(
            "invalid_model",
            f"unknown model {cfg.model!r}; this server has {known}",
            param="session.model",
        )
    _refuse_unsupported(cfg)
    audio = None if isinstance(cfg.audio, UnsetType) else cfg.audio
    fmt: AudioFormat | None = PCM16_24K if websocket else None
    voice_name, engine_voice = DEFAULT_VOICE, None
    if audio is not None:
        if isinstance(audio.format, LiveAudioFormat):
            if not websocket:
                raise ProtocolError(
                    "invalid_value",
                    "audio.format is for WebSocket sessions (WebRTC negotiates its own)",
                    param="session.audio.format",
                )
            fmt = _format(audio.format)
        out = audio.output
        if out is not None and not isinstance(out, UnsetType):
            if not isinstance(out.voice, UnsetType):
                voice_name, engine_voice = _voice(out.voice, voices)
    delegation = None if isinstance(cfg.delegation, UnsetType) else cfg.delegation
    target: Literal["client", "responses"] | None = None
    backend = None
    ack = 0
    if isinstance(delegation, ClientDelegation | ResponsesDelegation):
        target = "client" if isinstance(delegation, ClientDelegation) else "responses"
        delay = delegation.acknowledgement_delay_ms
        ack = delay if isinstance(delay, int) else 0
        if ack < 0:
            raise ProtocolError(
                "invalid_value", "must be >= 0", param="session.delegation.acknowledgement_delay_ms"
            )
        if isinstance(delegation, ResponsesDelegation):
            if isinstance(delegation.responses, UnsetType):
                raise ProtocolError(
                    "missing_required_parameter",
                    "responses is required",
                    param="session.delegation.responses",
                )
            backend = parse_backend(delegation.responses, options)
    client_instructions = cfg.instructions if isinstance(cfg.instructions, str) else None
    instructions = (client_instructions or "").strip() or default_instructions
    history = _history(cfg)
    return LiveStart(
        model=cfg.model,
        instructions=instructions,
        client_instructions=client_instructions,
        format=fmt,
        voice=voice_name,
        engine_voice=engine_voice,
        target=target,
        ack_delay_ms=ack,
        backend=backend,
        history=history,
        delegation_wire=None if delegation is None else msgspec.to_builtins(delegation),
        input_wire=(
            None
            if isinstance(cfg.input, UnsetType) or cfg.input is None
            else msgspec.to_builtins(cfg.input)
        ),
    )


def render_history(history: tuple[tuple[str, str], ...]) -> str:
    """The startup history as the thinker's instructions show it."""
    names = {"developer": "Note", "user": "User", "assistant": "You"}
    lines = [f"{names.get(role, role)}: {text}" for role, text in history]
    return "Conversation so far:\n" + "\n".join(lines) if lines else ""


def effective_session(
    start: LiveStart, template: EffectiveSession, options: LiveOptions
) -> EffectiveSession:
    """The shared core's configuration of a Live session (``template``: this front end's
    defaults, its voices and output rate)."""
    instructions = start.instructions
    rendered = render_history(start.history)
    if rendered:
        instructions = f"{instructions}\n\n{rendered}"
    fmt = start.format or template.input_format
    return replace(
        template,
        instructions=instructions,
        voice=start.engine_voice,
        input_format=fmt,
        output_format=fmt,
        turn_detection=interruption(options.turn_detection, options.interruption),
        model=start.model,
        output_modalities=("audio",),
        tools=(DELEGATE_TOOL,) if start.target is not None else (),
        tool_choice="auto",
        tool_name=None,
    )
