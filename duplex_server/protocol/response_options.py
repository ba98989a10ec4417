"""A ``response.create``'s overrides (pure): validated into the engine's
:class:`~duplex_contract.tools.ResponseOptions`, or refused with a :class:`ProtocolError`
naming the field (nothing is changed on error)."""

from __future__ import annotations

from collections.abc import Mapping

from msgspec import UnsetType

from duplex_contract.settings import Tool
from duplex_contract.tools import InputMessage, ResponseOptions, tool_result_note
from duplex_server.protocol import events as ev
from duplex_server.protocol.errors import ProtocolError
from duplex_server.protocol.session_config import parse_tool_choice, parse_tools


def response_options(
    param: ev.ResponseParam | None, tools: tuple[Tool, ...], calls: Mapping[str, str]
) -> tuple[ResponseOptions | None, dict[str, str] | None]:
    """The options and metadata of a ``response.create``; ``tools``: the session's (what a
    ``tool_choice`` may name when the response offers none of its own); ``calls``: the
    conversation's function calls (call id -> name) an ``input`` item may answer."""
    if param is None:
        return None, None
    conversation = param.conversation
    if isinstance(conversation, str) and conversation not in ("auto", "none"):
        raise ProtocolError(
            "unsupported",
            "conversation must be 'auto' or 'none'",
            param="response.conversation",
        )
    modalities = param.output_modalities
    if isinstance(modalities, UnsetType):
        modalities = param.modalities
    mods: tuple[ev.Modality, ...] | None = None
    if not isinstance(modalities, UnsetType):
        if not modalities:
            raise ProtocolError(
                "invalid_value",
                "output_modalities is empty",
                param="response.output_modalities",
            )
        mods = ("audio",) if "audio" in modalities else ("text",)
    max_tokens = param.max_output_tokens
    if isinstance(max_tokens, UnsetType):
        max_tokens = param.max_response_output_tokens
    if isinstance(max_tokens, int) and max_tokens < 1:
        raise ProtocolError(
            "invalid_value",
            "max_output_tokens must be >= 1",
            param="response.max_output_tokens",
        )
    own_tools = None
    if not isinstance(param.tools, UnsetType):
        own_tools = parse_tools(param.tools, "response.tools")
    choice, name = None, None
    if not isinstance(param.tool_choice, UnsetType):
        offered = own_tools if own_tools is not None else tools
        choice, name = parse_tool_choice(param.tool_choice, offered, "response.tool_choice")
    messages = None
    if not isinstance(param.input, UnsetType):
        messages = tuple(input_message(item, i, calls) for i, item in enumerate(param.input))
    options = ResponseOptions(
        instructions=None if isinstance(param.instructions, UnsetType) else param.instructions,
        output_modalities=mods,
        max_output_tokens=max_tokens if isinstance(max_tokens, int) else None,
        temperature=None if isinstance(param.temperature, UnsetType) else param.temperature,
        tools=own_tools,
        tool_choice=choice,
        tool_name=name,
        conversation="none" if conversation == "none" else "auto",
        input=messages,
    )
    metadata = None if isinstance(param.metadata, UnsetType) else param.metadata
    return options, metadata


def input_message(item: ev.ItemParam, i: int, calls: Mapping[str, str]) -> InputMessage:
    """One item of an out-of-band response's ``input``."""
    where = f"response.input.{i}"
    if item.type == "function_call_output":
        if not isinstance(item.call_id, str) or item.call_id not in calls:
            raise ProtocolError("invalid_value", "unknown call_id", param=f"{where}.call_id")
        output = item.output if isinstance(item.output, str) else ""
        text = tool_result_note(calls[item.call_id], None, output)
        return InputMessage(role="system", content=text)
    if item.type != "message":
        raise ProtocolError(
            "unsupported", "input items are messages or function_call_output", param=f"{where}.type"
        )
    texts: list[str] = []
    for j, part in enumerate(item.content):
        piece = part.text if isinstance(part.text, str) else part.transcript
        if not isinstance(piece, str):
            raise ProtocolError(
                "unsupported", "input content must be text", param=f"{where}.content.{j}"
            )
        texts.append(piece)
    return InputMessage(role=item.role, content=" ".join(t for t in texts if t))
