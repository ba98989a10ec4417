"""Function calls in the engine: streaming the arguments out of the call JSON, validating
calls, and the history's tool turns and deletions."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from duplex_contract.settings import Tool
from duplex_contract.tools import (
    TOOL_ANSWER_HINT,
    TOOL_RESULT_MARK,
    ToolCall,
    ToolCallError,
    ToolOutput,
    active_tools,
    call_schema,
    check_call,
    check_schema,
    tool_result_note,
)
from engine.orchestration.history import ConversationHistory
from engine.orchestration.tool_calls import CallStream

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
    msgs = h.messages("sys")  # the call, its result not come yet
    assert [(m.role, m.content) for m in msgs[1:]] == [
        ("user", "wake me at 7"),
        ("system", 'You called set_alarm with {"hour": 7}.\n' + TOOL_ANSWER_HINT),
    ]
    h.add_tool_output(ToolOutput("call_1", "set_alarm", "ok " + "x" * 500, "item_t1"), 2)
    msgs = h.messages("sys")
    assert [m.role for m in msgs] == ["system", "user", "system"]
    assert msgs[2].content.startswith('You called set_alarm with {"hour": 7}; it returned ok x')
    assert "characters cut]" in msgs[2].content and msgs[2].content.endswith(TOOL_ANSWER_HINT)
    assert h.delete_item("item_t1") and not h.delete_item("item_t1")
    assert h.delete_assistant(1, 1) and not h.delete_assistant(1, 1)
    assert [m.content for m in h.messages("sys")] == ["sys", "wake me at 7"]
    assert h.delete_item("item_u1")
    assert len(h.messages("sys")) == 1


def test_history_tool_result_is_a_note_not_a_call_to_repeat() -> None:
    """After a result the prompt holds no call JSON for the model to copy: the call and its
    result are one system note, ending with the hint to answer while it is unanswered; once
    answered, the note stays in place (no hint) and the conversation goes on after it."""
    h = ConversationHistory(budget_chars=1000)
    h.add_user("Weather in Paris?", 1, "u1")
    h.start_assistant(1, 1)
    call = ToolCall(call_id="c1", name="get_weather", arguments='{"city":"Paris"}')
    h.set_tool_call(1, 1, call)
    h.finish_assistant(1, 1, "completed")
    h.add_tool_output(ToolOutput("c1", "get_weather", '{"celsius": 21}', "t1"), 2)
    msgs = h.messages("sys")
    note = 'You called get_weather with {"city": "Paris"}; it returned celsius 21.'
    assert [(m.role, m.content) for m in msgs] == [
        ("system", "sys"),
        ("user", "Weather in Paris?"),
        ("system", f"{note}\n{TOOL_ANSWER_HINT}"),
    ]
    assert not any('"name"' in m.content for m in msgs)
    h.start_assistant(2, 1)
    h.append_assistant_text(2, 1, "It is 21 degrees in Paris.")
    h.finish_assistant(2, 1, "completed")
    h.add_user("Thanks!", 3, "u3")
    assert [(m.role, m.content) for m in h.messages("sys")[1:]] == [
        ("user", "Weather in Paris?"),
        ("system", note),
        ("assistant", "It is 21 degrees in Paris."),
        ("user", "Thanks!"),
    ]
    # trimmed to the newest turns, the kept part still starts with a user message
    small = ConversationHistory(budget_chars=len("It is 21 degrees in Paris.Thanks!") + len(note))
    small.add_user("Weather in Paris?", 1, "u1")
    small.start_assistant(1, 1)
    small.set_tool_call(1, 1, call)
    small.finish_assistant(1, 1, "completed")
    small.add_tool_output(ToolOutput("c1", "get_weather", '{"celsius": 21}', "t1"), 2)
    small.start_assistant(2, 1)
    small.append_assistant_text(2, 1, "It is 21 degrees in Paris.")
    small.finish_assistant(2, 1, "completed")
    small.add_user("Thanks!", 3, "u3")
    assert [m.role for m in small.messages("sys")] == ["system", "user"]


def test_tool_result_note_shapes() -> None:
    assert tool_result_note("get_time", "{}", "14:05") == "You called get_time; it returned 14:05."
    assert tool_result_note("f", None, " done. ") == "You called f; it returned done."
    assert tool_result_note("f", "not json", "x") == "You called f with not json; it returned x."
    assert TOOL_RESULT_MARK in tool_result_note("f", '{"a": 1}', "x")
    # a flat JSON object reads as words; anything else stays as it came
    flat = tool_result_note("f", None, '{"sky": "sunny", "celsius": 21, "rain": false}')
    assert flat == "You called f; it returned sky sunny, celsius 21, rain false."
    nested = '{"days": [1, 2]}'
    assert tool_result_note("f", None, nested) == f"You called f; it returned {nested}."
    assert tool_result_note("f", None, "[1]") == "You called f; it returned [1]."
