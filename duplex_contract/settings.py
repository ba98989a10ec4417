"""What a session asks of the engine: the one settings struct and its patch form."""

from __future__ import annotations

from typing import Literal

import msgspec

from duplex_contract.audio import OUTPUT_RATE
from duplex_contract.languages import DEFAULT_LANGUAGE

Modality = Literal["text", "audio"]
ToolChoice = Literal["auto", "none", "required", "function"]


class Tool(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A function the model may call; ``parameters`` is its JSON Schema as JSON text."""

    name: str
    description: str = ""
    parameters: str = '{"type": "object"}'


class SessionSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A session's engine settings (``OpenCall.config``; a session.update replaces them).

    ``max_output_tokens=None`` means the engine default; ``temperature=None`` means greedy.
    ``language`` is the ISO-639-1 code the user's speech is transcribed in
    (:mod:`duplex_contract.languages`).
    """

    instructions: str = ""
    voice: str | None = None
    output_modalities: tuple[Modality, ...] = ("audio",)
    max_output_tokens: int | None = None
    temperature: float | None = None
    output_sample_rate: int = OUTPUT_RATE
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = "auto"
    tool_name: str | None = None  # tool_choice "function": the function to call
    language: str = DEFAULT_LANGUAGE


class SessionUpdate(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A patch of :class:`SessionSettings`: ``None`` leaves a field untouched.

    ``settings``, when given, replaces the whole settings at once (``None`` fields
    included: that is how a max_output_tokens limit is lifted again).
    """

    instructions: str | None = None
    voice: str | None = None
    output_modalities: tuple[Modality, ...] | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    tools: tuple[Tool, ...] | None = None
    tool_choice: ToolChoice | None = None
    tool_name: str | None = None
    language: str | None = None
    settings: SessionSettings | None = None

    @classmethod
    def replace_with(cls, settings: SessionSettings) -> SessionUpdate:
        return cls(settings=settings)

    def apply(self, current: SessionSettings) -> SessionSettings:
        if self.settings is not None:
            return self.settings
        changes = {
            name: getattr(self, name) for name in PATCH_FIELDS if getattr(self, name) is not None
        }
        return msgspec.structs.replace(current, **changes)


#: the settings a patch can change field by field (all but the output rate).
PATCH_FIELDS: tuple[str, ...] = tuple(
    f for f in SessionSettings.__struct_fields__ if f != "output_sample_rate"
)
