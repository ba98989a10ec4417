"""Function calls in the engine: streaming the arguments out of the call JSON, validating
calls, and the history's tool turns and deletions."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from duplex_contract.settings import Tool
from duplex_contract.tools import (
    ToolCall,
    ToolCallError,
    ToolOutput,
    active_tools,
    call_schema,
    check_call,
    check_schema,
)
from engine.history import ConversationHistory
from engine.tool_calls import CallStream

HOUR = Tool(
    name="set_alarm",
    parameters=json.dumps(
        {
            "type": "object",
            "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}},
            "required": ["hour"],
        }
    ),
)
NOARGS = Tool(name="get_time")


@given(
    args=st.dictionaries(st.text(max_size=5), st.integers() | st.text(max_size=5), max_size=3),
    cuts=st.lists(st.integers(min_value=1, max_value=200), max_size=8),
    pretty=st.booleans(),
)
def test_call_stream_deltas_join_to_the_arguments(
    args: dict[str, object], cuts: list[int], pretty: bool
) -> None:
    """However the call JSON is split into pieces, the deltas join to the arguments text."""
    sep = (", ", ": ") if pretty else (",", ":")
    args_text = json.dumps(args, separators=sep)
    text = f'{{"name": "f", "arguments": {args_text}}}' + (" \n" if pretty else "")
    stream, deltas, at = CallStream(), [], 0
    for cut in [*sorted(set(cuts)), len(text)]:
        deltas.append(stream.push(text[at:cut]))
        at = max(at, cut)
    deltas.append(stream.finish())
    assert stream.name == "f"
    assert "".join(deltas) == args_text == stream.arguments()


def test_call_stream_holds_back_only_the_closing_run() -> None:
    stream = CallStream()
    assert stream.push('{"name": "get_time", "argu') == ""
    assert stream.push('ments": {"a": {"b": 1}') == '{"a": {"b": 1'
    assert stream.push(', "c": 2}') == '}, "c": 2'  # the held "}" was not the end
    assert stream.push(" }") == ""  # may be the outer close: held back
    assert stream.finish() == "}"
    assert stream.arguments() == '{"a": {"b": 1}, "c": 2}'


def test_check_call_validates_name_json_and_schema() -> None:
    call = check_call('{"name": "set_alarm", "arguments": {"hour": 7}}', (HOUR, NOARGS))
    assert call == ToolCall(call_id="", name="set_alarm", arguments='{"hour":7}')
    with pytest.raises(ToolCallError, match="not JSON"):
        check_call('{"name": "set_alarm", "arguments": {"hour": 7}', (HOUR,))
    with pytest.raises(ToolCallError, match="unknown function"):
        check_call('{"name": "nope", "arguments": {}}', (HOUR,))
    with pytest.raises(ToolCallError, match="schema"):  # maximum: beyond what a grammar checks
        check_call('{"name": "set_alarm", "arguments": {"hour": 31}}', (HOUR,))


def test_tool_choice_and_schemas() -> None:
    tools = (HOUR, NOARGS)
    assert active_tools(tools, "none", None) == ()
    assert active_tools(tools, "auto", None) == tools
    assert active_tools(tools, "function", "get_time") == (NOARGS,)
    assert call_schema((NOARGS,))["properties"]["name"] == {"const": "get_time"}
    assert len(call_schema(tools)["anyOf"]) == 2
    assert check_schema({"type": "object"}) is None
    assert check_schema({"type": 5}) is not None and check_schema([1]) is not None


def test_history_tool_turns_and_deletes() -> None:
    h = ConversationHistory(budget_chars=400)
    h.add_user("wake me at 7", 1, "item_u1")
    h.start_assistant(1, 1)
    h.set_tool_call(1, 1, ToolCall(call_id="call_1", name="set_alarm", arguments='{"hour":7}'))
    h.finish_assistant(1, 1, "completed")
    h.add_tool_output(ToolOutput("call_1", "set_alarm", "ok " + "x" * 500, "item_t1"), 2)
    msgs = h.messages("sys")
    assert [m.role for m in msgs] == ["system", "user", "assistant", "user"]
    assert json.loads(msgs[2].content) == {"name": "set_alarm", "arguments": {"hour": 7}}
    assert (
        msgs[3].content.startswith("<tool_response>\nok x") and "characters cut]" in msgs[3].content
    )
    assert h.delete_item("item_t1") and not h.delete_item("item_t1")
    assert h.delete_assistant(1, 1) and not h.delete_assistant(1, 1)
    assert [m.content for m in h.messages("sys")] == ["sys", "wake me at 7"]
    assert h.delete_item("item_u1")
    assert len(h.messages("sys")) == 1
