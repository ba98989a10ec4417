"""Function calling and per-response options: what crosses the boundary, and the checks
both sides share.

A tool is a function the model may call: :class:`~duplex_contract.settings.Tool` (name,
description and its parameters' JSON Schema as JSON text, so the struct stays hashable).
``tool_choice`` is ``"auto"`` (the model chooses between text and a call), ``"none"`` (no
call), ``"required"`` (some call) or ``"function"`` with ``tool_name`` (that call). A call
is the JSON object
``{"name": NAME, "arguments": {...}}`` (:func:`call_schema` is its schema); engines
constrain their decoding to it, and :func:`check_call` validates the arguments once more.

:class:`ResponseOptions` are the overrides of one ``response.create`` (GA
``response{instructions, tools, tool_choice, conversation, input, ...}``).
"""

from __future__ import annotations

import json
from typing import Any, Literal

import msgspec

from duplex_contract.settings import Modality, Tool, ToolChoice

#: in every function result as a prompt shows it (:func:`tool_result_note`)
TOOL_RESULT_MARK = "; it returned "
#: after a result the model has not answered yet (the last message of the prompt)
TOOL_ANSWER_HINT = "Tell the user the answer in one sentence."


def _with_args(name: str, arguments: str | None) -> str:
    if arguments is None:
        return name
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return f"{name} with {arguments}"
    return f"{name} with {json.dumps(value)}" if value else name


def tool_call_note(name: str, arguments: str | None) -> str:
    """A call whose result has not come, as the prompt shows it (a system message)."""
    return f"You called {_with_args(name, arguments)}."


def _readable(output: str) -> str:
    """A flat JSON object as ``key value, key value`` (a small model reads words better than
    JSON: SmolLM2-135M used the result in 7 of 8 sample answers so, 4 of 8 as JSON); any
    other output as it is."""
    try:
        value = json.loads(output)
    except json.JSONDecodeError:
        return output
    if not isinstance(value, dict) or not value:
        return output
    if any(isinstance(v, dict | list) for v in value.values()):
        return output
    return ", ".join(f"{k} {v if isinstance(v, str) else json.dumps(v)}" for k, v in value.items())


def tool_result_note(name: str, arguments: str | None, output: str) -> str:
    """A function's result as the prompt shows it: a system message after the user turn it
    answers, naming the call, instead of the call JSON and a ``tool_response`` turn (which
    a small model without tool training repeats as its answer)."""
    output = _readable(output.strip())
    end = "" if output.endswith((".", "!", "?")) else "."
    return f"You called {_with_args(name, arguments)}{TOOL_RESULT_MARK}{output}{end}"


def tool_schema(tool: Tool) -> dict[str, Any]:
    value = json.loads(tool.parameters)
    return value if isinstance(value, dict) else {}


class InputMessage(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One message of an out-of-band response's own ``input``."""

    role: Literal["system", "user", "assistant"]
    content: str


class ToolOutput(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A ``function_call_output`` item: the result of the call ``call_id``."""

    call_id: str
    name: str
    output: str
    item_id: str | None = None


class ToolCall(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A call the model made (kept in the engine's history)."""

    call_id: str
    name: str
    arguments: str


class ResponseOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Overrides of one response; ``None`` keeps the session's value."""

    instructions: str | None = None
    output_modalities: tuple[Modality, ...] | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    tools: tuple[Tool, ...] | None = None
    tool_choice: ToolChoice | None = None
    tool_name: str | None = None
    #: "none": out of band, the response is not added to the conversation
    conversation: Literal["auto", "none"] = "auto"
    #: out of band: the prompt is these messages instead of the conversation
    input: tuple[InputMessage, ...] | None = None


class ItemRef(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """An item the engine holds (``conversation.item.delete``): a user or tool item by its
    ``item_id``, or an assistant turn (message or call) by ``turn_id``/``response_seq``."""

    item_id: str | None = None
    turn_id: int | None = None
    response_seq: int | None = None


class ToolCallError(ValueError):
    """A call that is not valid JSON, names no known tool, or breaks the schema."""


def active_tools(tools: tuple[Tool, ...], choice: ToolChoice, name: str | None) -> tuple[Tool, ...]:
    """The tools the model may call under ``choice`` (empty: answer with text)."""
    if choice == "none" or not tools:
        return ()
    if choice == "function":
        return tuple(t for t in tools if t.name == name)
    return tools


def call_schema(tools: tuple[Tool, ...]) -> dict[str, Any]:
    """The JSON Schema of one call of any of ``tools``: ``{"name", "arguments"}``."""
    variants = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, "arguments": tool_schema(t)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    return variants[0] if len(variants) == 1 else {"anyOf": variants}


def tools_prompt(tools: tuple[Tool, ...], required: bool) -> str:
    """What the system prompt says about the tools."""
    lines = [
        "You can call these functions. To call one, answer with only a JSON object "
        '{"name": <function name>, "arguments": <arguments object>}.'
        + ("" if required else " Otherwise answer in plain text."),
    ]
    for t in tools:
        desc = f": {t.description}" if t.description else ""
        lines.append(f"- {t.name}{desc} Parameters (JSON Schema): {t.parameters}")
    return "\n".join(lines)


def check_call(text: str, tools: tuple[Tool, ...]) -> ToolCall:
    """Parse and validate a call; raises :class:`ToolCallError`. ``call_id`` is empty."""
    import jsonschema

    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ToolCallError(f"the call is not JSON: {exc}") from None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        raise ToolCallError("the call is not an object with a name")
    tool = next((t for t in tools if t.name == value["name"]), None)
    if tool is None:
        raise ToolCallError(f"the call names an unknown function {value['name']!r}")
    args = value.get("arguments")
    try:
        jsonschema.validate(args, tool_schema(tool))
    except jsonschema.ValidationError as exc:
        raise ToolCallError(f"the arguments break the schema: {exc.message}") from None
    return ToolCall(call_id="", name=tool.name, arguments=json.dumps(args, separators=(",", ":")))


def check_schema(schema: Any) -> str | None:
    """Why ``schema`` is not a usable JSON Schema of function arguments (None: it is)."""
    import jsonschema

    if not isinstance(schema, dict):
        return "parameters must be a JSON Schema object"
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        return f"parameters is not a valid JSON Schema: {exc.message}"
    return None
