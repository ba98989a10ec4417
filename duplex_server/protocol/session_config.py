"""The effective session configuration and how a ``session.update`` patch changes it."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal, TypeVar

import msgspec
from msgspec import UnsetType

from duplex_contract.audio import OUTPUT_RATE
from duplex_contract.languages import DEFAULT_LANGUAGE, language_problem
from duplex_contract.settings import SessionSettings, Tool, ToolChoice
from duplex_contract.tools import check_schema
from duplex_contract.voices import VoiceCatalog
from duplex_server.protocol.codec import PCM16_24K, AudioFormat, parse_format
from duplex_server.protocol.errors import ProtocolError
from duplex_server.protocol.events import (
    AudioConfigOut,
    AudioFormatParam,
    AudioInputOut,
    AudioOutputOut,
    Modality,
    NoiseReductionOut,
    SessionObj,
    SessionParam,
    ToolChoiceFunction,
    ToolChoiceObj,
    ToolChoiceParam,
    ToolObj,
    ToolParam,
    TranscriptionOut,
    TranscriptionParam,
    TurnDetection,
    TurnDetectionParam,
)

T = TypeVar("T")
_DEFAULT_TD = TurnDetection()
#: the fields of turn_detection that say how an interruption is judged, kept when the
#: turn detection's type changes (the guards before them reset with it, as they always did)
_INTERRUPTION_FIELDS = ("interrupt_mode", "confirm_window_ms", "backchannels")
MAX_BACKCHANNELS = 200
MAX_BACKCHANNEL_CHARS = 64
#: semantic_vad: the longest silence a turn that does not sound finished waits for (it is
#: also the session's ``silence_duration_ms`` unless the client sets one)
SEMANTIC_MAX_WAIT_MS = {"low": 3000, "medium": 1500, "auto": 1500, "high": 1000}


@dataclass(frozen=True, slots=True)
class EffectiveSession:
    """Everything a session.update can change. Defaults are docs/protocol.md's."""

    instructions: str = ""
    voice: str | None = None
    speed: float = 1.0
    output_modalities: tuple[Modality, ...] = ("audio",)
    input_format: AudioFormat = PCM16_24K
    output_format: AudioFormat = PCM16_24K
    turn_detection: TurnDetection | None = _DEFAULT_TD
    max_output_tokens: int | None = None
    temperature: float | None = None
    event_names: Literal["ga", "beta"] = "ga"
    model: str = "duplex"
    session_type: Literal["realtime", "transcription"] = "realtime"
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = "auto"
    tool_name: str | None = None
    noise_reduction: Literal["near_field", "far_field"] | None = None
    #: extension: the transport cancels the server's own output (echo) from the input
    echo_cancellation: bool = False
    #: ``audio.input.transcription.language``: what the user's speech is transcribed in
    language: str = DEFAULT_LANGUAGE
    #: extension: keypad digits become user text items (protocol/dtmf.py)
    dtmf_as_text: bool = False
    #: the rate the engine speaks at (server config ``engine.output_sample_rate``; the
    #: output encoder converts it to ``output_format``); not on the wire
    output_rate: int = OUTPUT_RATE
    #: the voices the engine speaks in (None: not known, any name is passed on); not on
    #: the wire
    voices: VoiceCatalog | None = None

    def settings(self) -> SessionSettings:
        """What the engine is told of this session (the rest is the server's own)."""
        return SessionSettings(
            instructions=self.instructions,
            voice=self.voices.resolve(self.voice) if self.voices is not None else self.voice,
            output_modalities=self.output_modalities,
            max_output_tokens=self.max_output_tokens,
            temperature=self.temperature,
            output_sample_rate=self.output_rate,
            tools=self.tools,
            tool_choice=self.tool_choice,
            tool_name=self.tool_name,
            language=self.language,
        )

    @property
    def beta(self) -> bool:
        """Are events named as in the beta Realtime API (``realtime=v1``)?"""
        return self.event_names == "beta"

    @property
    def create_response(self) -> bool:
        """Does a VAD commit create a response (never in a transcription session)?"""
        td = self.turn_detection
        return self.session_type == "realtime" and td is not None and td.create_response

    def to_wire(self, session_id: str) -> SessionObj:
        return SessionObj(
            id=session_id,
            model=self.model,
            instructions=self.instructions,
            output_modalities=list(self.output_modalities),
            audio=AudioConfigOut(
                input=AudioInputOut(
                    format=self.input_format.to_wire(),
                    turn_detection=self.turn_detection,
                    transcription=TranscriptionOut(language=self.language),
                    noise_reduction=(
                        None
                        if self.noise_reduction is None
                        else NoiseReductionOut(type=self.noise_reduction)
                    ),
                    echo_cancellation=self.echo_cancellation,
                    dtmf_as_text=self.dtmf_as_text,
                ),
                output=AudioOutputOut(
                    format=self.output_format.to_wire(), voice=self.voice, speed=self.speed
                ),
            ),
            max_output_tokens="inf" if self.max_output_tokens is None else self.max_output_tokens,
            temperature=self.temperature,
            event_names=self.event_names,
            type=self.session_type,
            tools=[
                ToolObj(
                    name=t.name,
                    description=t.description,
                    parameters=msgspec.json.decode(t.parameters),
                )
                for t in self.tools
            ],
            tool_choice=(
                ToolChoiceObj(name=self.tool_name or "")
                if self.tool_choice == "function"
                else self.tool_choice
            ),
        )


def parse_tools(params: list[ToolParam], field: str) -> tuple[Tool, ...]:
    """Wire tools -> engine tools; refuses bad schemas and duplicate names."""
    tools: list[Tool] = []
    for i, t in enumerate(params):
        if not t.name or any(x.name == t.name for x in tools):
            raise ProtocolError(
                "invalid_value",
                f"tool name {t.name!r} is empty or repeated",
                param=f"{field}.{i}.name",
            )
        schema = {"type": "object"} if isinstance(t.parameters, UnsetType) else t.parameters
        problem = check_schema(schema)
        if problem is not None:
            raise ProtocolError("invalid_value", problem, param=f"{field}.{i}.parameters")
        description = "" if isinstance(t.description, UnsetType) else t.description
        tools.append(Tool(t.name, description, msgspec.json.encode(schema).decode()))
    return tuple(tools)


def parse_tool_choice(
    choice: ToolChoiceParam, tools: tuple[Tool, ...], field: str
) -> tuple[ToolChoice, str | None]:
    """``tool_choice`` -> (choice, function name); a named function must be among ``tools``."""
    if isinstance(choice, ToolChoiceFunction):
        if not any(t.name == choice.name for t in tools):
            raise ProtocolError(
                "invalid_value",
                f"tool_choice names an unknown function {choice.name!r}",
                param=f"{field}.name",
            )
        return "function", choice.name
    return choice, None


def _pick(ga: T | UnsetType, beta: T | UnsetType) -> T | UnsetType:
    return beta if isinstance(ga, UnsetType) else ga


def _turn_detection(
    current: TurnDetection | None, param: TurnDetectionParam | None
) -> TurnDetection | None:
    if param is None:
        return None
    base = current if current is not None else TurnDetection()
    if base.type != param.type:  # a new kind starts from its own defaults ...
        # ... but how an interruption is judged is not the VAD's: it stays
        kept = {name: getattr(base, name) for name in _INTERRUPTION_FIELDS}
        base = TurnDetection(**kept)
    changes: dict[str, object] = {}
    for name in (
        "threshold",
        "prefix_padding_ms",
        "silence_duration_ms",
        "create_response",
        "interrupt_response",
        "idle_timeout_ms",
        "min_interrupt_speech_ms",
        "uninterruptible_ms",
        "interrupt_mode",
        "confirm_window_ms",
    ):
        value = getattr(param, name)
        if not isinstance(value, UnsetType):
            changes[name] = value
    if not isinstance(param.backchannels, UnsetType):
        changes["backchannels"] = _backchannels(param.backchannels)
    if param.type == "semantic_vad":
        eagerness = param.eagerness if isinstance(param.eagerness, str) else base.eagerness
        eagerness = eagerness or "auto"
        silence = SEMANTIC_MAX_WAIT_MS.get(eagerness)
        if silence is None:
            raise ProtocolError(
                "invalid_value",
                f"eagerness must be one of low, medium, high, auto; got {eagerness!r}",
                param="turn_detection.eagerness",
            )
        changes["type"] = "semantic_vad"
        changes["eagerness"] = eagerness
        cue = param.end_of_turn if isinstance(param.end_of_turn, str) else base.end_of_turn
        changes["end_of_turn"] = cue or "audio"
        if base.type != "semantic_vad" or not isinstance(param.eagerness, UnsetType):
            changes.setdefault("silence_duration_ms", silence)
    else:
        for name in ("eagerness", "end_of_turn"):
            if not isinstance(getattr(param, name), UnsetType):
                raise ProtocolError(
                    "invalid_value",
                    f"{name} applies to semantic_vad only",
                    param=f"turn_detection.{name}",
                )
    out = msgspec.structs.replace(base, **changes)
    if not 0.0 <= out.threshold <= 1.0:
        raise ProtocolError(
            "invalid_value", "threshold must be within [0, 1]", param="turn_detection.threshold"
        )
    for name in (
        "prefix_padding_ms",
        "silence_duration_ms",
        "min_interrupt_speech_ms",
        "confirm_window_ms",
    ):
        if getattr(out, name) < 0:
            raise ProtocolError(
                "invalid_value", f"{name} must be >= 0", param=f"turn_detection.{name}"
            )
    return out


def _backchannels(words: list[str] | None) -> tuple[str, ...] | None:
    """``turn_detection.backchannels``: phrases a listener says that never interrupt (None:
    the default list); at most ``MAX_BACKCHANNELS``, each non-empty and short."""
    if words is None:
        return None
    if len(words) > MAX_BACKCHANNELS:
        raise ProtocolError(
            "invalid_value",
            f"backchannels holds at most {MAX_BACKCHANNELS} phrases",
            param="turn_detection.backchannels",
        )
    for i, w in enumerate(words):
        if not w.strip() or len(w) > MAX_BACKCHANNEL_CHARS:
            raise ProtocolError(
                "invalid_value",
                f"a backchannel is a phrase of 1-{MAX_BACKCHANNEL_CHARS} characters",
                param=f"turn_detection.backchannels.{i}",
            )
    return tuple(w.strip() for w in words)


def _language(
    ga: TranscriptionParam | UnsetType | None, beta: TranscriptionParam | UnsetType | None
) -> str | UnsetType:
    """The transcription language a patch sets (``null`` or an omitted language: English
    again); the GA field wins over the beta one."""
    param, field = ga, "audio.input.transcription"
    if isinstance(ga, UnsetType):
        param, field = beta, "input_audio_transcription"
    if isinstance(param, UnsetType) or param is None or isinstance(param.language, UnsetType):
        return msgspec.UNSET
    if param.language is None:
        return DEFAULT_LANGUAGE
    code = param.language.strip().lower()
    problem = language_problem(code)
    if problem is not None:
        raise ProtocolError(
            "invalid_value", f"{field}.language {problem}", param=f"{field}.language"
        )
    return code


def apply_patch(current: EffectiveSession, patch: SessionParam) -> EffectiveSession:
    """Return the session after ``patch``; raises ProtocolError (nothing changed) if invalid."""
    changes: dict[str, object] = {}
    if not isinstance(patch.instructions, UnsetType):
        changes["instructions"] = patch.instructions
    if not isinstance(patch.model, UnsetType):
        changes["model"] = patch.model
    modalities = _pick(patch.output_modalities, patch.modalities)
    if not isinstance(modalities, UnsetType):
        if not modalities or len(set(modalities)) != len(modalities):
            raise ProtocolError(
                "invalid_value",
                "output_modalities must be ['text'], ['audio'] or ['text', 'audio']",
                param="output_modalities",
            )
        # Audio always carries its transcript, so ["text", "audio"] means audio.
        changes["output_modalities"] = ("audio",) if "audio" in modalities else ("text",)
    audio_in = audio_out = None
    if not isinstance(patch.audio, UnsetType):
        audio_in = None if isinstance(patch.audio.input, UnsetType) else patch.audio.input
        audio_out = None if isinstance(patch.audio.output, UnsetType) else patch.audio.output
    in_fmt: AudioFormatParam | UnsetType = patch.input_audio_format
    if audio_in is not None and not isinstance(audio_in.format, UnsetType):
        in_fmt = audio_in.format
    if not isinstance(in_fmt, UnsetType):
        changes["input_format"] = parse_format(in_fmt, field="audio.input.format", output=False)
    out_fmt: AudioFormatParam | UnsetType = patch.output_audio_format
    if audio_out is not None and not isinstance(audio_out.format, UnsetType):
        out_fmt = audio_out.format
    if not isinstance(out_fmt, UnsetType):
        changes["output_format"] = parse_format(out_fmt, field="audio.output.format", output=True)
    voice = patch.voice if audio_out is None else _pick(audio_out.voice, patch.voice)
    if not isinstance(voice, UnsetType):
        ga = audio_out is not None and not isinstance(audio_out.voice, UnsetType)
        problem = current.voices.problem(voice) if voice and current.voices else None
        if problem is not None:
            field = "audio.output.voice" if ga else "voice"
            raise ProtocolError("invalid_value", f"{field}: {problem}", param=field)
        changes["voice"] = voice or None
    speed = patch.speed if audio_out is None else _pick(audio_out.speed, patch.speed)
    if not isinstance(speed, UnsetType):
        if not 0.25 <= speed <= 4.0:
            raise ProtocolError("invalid_value", "speed must be within [0.25, 4]", param="speed")
        changes["speed"] = speed
    if audio_in is not None and not isinstance(audio_in.echo_cancellation, UnsetType):
        changes["echo_cancellation"] = bool(audio_in.echo_cancellation)
    if audio_in is not None and not isinstance(audio_in.dtmf_as_text, UnsetType):
        changes["dtmf_as_text"] = audio_in.dtmf_as_text
    language = _language(
        audio_in.transcription if audio_in is not None else msgspec.UNSET,
        patch.input_audio_transcription,
    )
    if not isinstance(language, UnsetType):
        changes["language"] = language
    td: TurnDetectionParam | UnsetType | None = patch.turn_detection
    if audio_in is not None and not isinstance(audio_in.turn_detection, UnsetType):
        td = audio_in.turn_detection
    if not isinstance(td, UnsetType):
        changes["turn_detection"] = _turn_detection(current.turn_detection, td)
    max_tokens = _pick(patch.max_output_tokens, patch.max_response_output_tokens)
    if not isinstance(max_tokens, UnsetType):
        if isinstance(max_tokens, int) and max_tokens < 1:
            raise ProtocolError(
                "invalid_value",
                "max_output_tokens must be >= 1 or 'inf'",
                param="max_output_tokens",
            )
        changes["max_output_tokens"] = None if max_tokens == "inf" else max_tokens
    if not isinstance(patch.temperature, UnsetType):
        changes["temperature"] = patch.temperature
    if not isinstance(patch.event_names, UnsetType):
        changes["event_names"] = patch.event_names
    if not isinstance(patch.type, UnsetType):
        changes["session_type"] = patch.type
    tools = current.tools
    if not isinstance(patch.tools, UnsetType):
        tools = changes["tools"] = parse_tools(patch.tools, "tools")
    if not isinstance(patch.tool_choice, UnsetType):
        changes["tool_choice"], changes["tool_name"] = parse_tool_choice(
            patch.tool_choice, tools, "tool_choice"
        )
    elif current.tool_choice == "function" and not any(t.name == current.tool_name for t in tools):
        raise ProtocolError(
            "invalid_value",
            f"tool_choice names {current.tool_name!r}, which the new tools lack",
            param="tools",
        )
    nr = _pick(
        audio_in.noise_reduction if audio_in is not None else msgspec.UNSET,
        patch.input_audio_noise_reduction,
    )
    if not isinstance(nr, UnsetType):
        changes["noise_reduction"] = None if nr is None else nr.type
    return replace(current, **changes)  # type: ignore[arg-type]
