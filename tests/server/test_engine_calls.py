"""The session runtime's one translation of a core command into a contract call
(duplex_server/session/engine_calls.py), and its call queue; pure, no engine."""

from __future__ import annotations

import asyncio
import dataclasses
import types
import typing
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from duplex_contract.control import (
    AppendCall,
    CloseCall,
    CommitCall,
    ControlCall,
    ControlResult,
    PlaybackMark,
    ReplicaCall,
    SignalCall,
    TouchCall,
)
from duplex_contract.fence import Fence
from duplex_contract.session_events import SessionEvent
from duplex_contract.settings import SessionSettings, SessionUpdate
from duplex_contract.tools import ItemRef, ToolOutput
from duplex_server.protocol.commands import (
    CORE_FIELDS,
    Append,
    Cancel,
    CloseSession,
    Commit,
    DeleteItem,
    EngineCommand,
    Replicate,
    Speculate,
    Touch,
    Update,
)
from duplex_server.session.engine_calls import CallQueue, engine_call, execute

SID = "sess_0123456789abcdef0123456789abcdef"


@dataclass
class At:
    """A session position (what the protocol core gives the translation)."""

    epoch: int = 2
    turn_id: int = 5
    response_seq: int = 4
    lease_generation: int = 3

    def fence_for(self, epoch: int) -> Fence:
        return Fence(SID, epoch, self.turn_id, self.response_seq)


def _commands() -> tuple[type[EngineCommand], ...]:
    return typing.get_args(EngineCommand)


def _members(tp: object) -> set[object]:
    """A type as the set of what it admits: a union's members, a Literal's values."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return set().union(*(_members(a) for a in typing.get_args(tp)))
    if typing.get_origin(tp) is typing.Literal:
        return {("literal", v) for v in typing.get_args(tp)}
    return {tp}


def _allowed(narrow: object, wide: object) -> bool:
    """A command's field type fits the contract's: the same, or narrower (a Literal's
    subset, a member of an optional)."""
    return _members(narrow) <= _members(wide)


@pytest.mark.parametrize("command", _commands(), ids=lambda c: c.__name__)
def test_each_command_field_is_its_contract_calls_field(command: type[EngineCommand]) -> None:
    """The translation copies by name: every field a command has besides the core's own
    (epoch, event_id) is a field of the contract call it names, of a type that fits."""
    hints = typing.get_type_hints(command)
    call_hints = typing.get_type_hints(command.CALL)
    for field in dataclasses.fields(command):
        if field.name in CORE_FIELDS:
            continue
        assert field.name in command.CALL.__struct_fields__, (command, field.name)
        assert _allowed(hints[field.name], call_hints[field.name]), (command, field.name)


def test_commands_become_contract_calls_fenced_at_call_time() -> None:
    at = Fence(SID, 1, 5, 4)
    out = ToolOutput(call_id="c", name="f", output="{}", item_id="i2")
    update = SessionUpdate.replace_with(SessionSettings(instructions="x"))
    mark = PlaybackMark(5, 4, 120.0, truncate=True)
    cases: list[tuple[EngineCommand, ControlCall]] = [
        (
            Append(1, audio=b"\0\0", stream_ms=40.0, seq=7, event_id="e1"),
            AppendCall(fence=at, lease_generation=3, audio=b"\0\0", stream_ms=40.0, seq=7),
        ),
        (
            Append(1, item_id="i2", tool_output=out),
            AppendCall(fence=at, lease_generation=3, item_id="i2", tool_output=out),
        ),
        (
            Commit(1, respond=False, item_id="i1", traceparent="00-x"),
            CommitCall(
                fence=at, lease_generation=3, respond=False, item_id="i1", traceparent="00-x"
            ),
        ),
        (
            DeleteItem(1, ItemRef(item_id="i1")),
            SignalCall(fence=at, lease_generation=3, event="item.delete", item=ItemRef("i1")),
        ),
        (
            Update(1, update),
            SignalCall(fence=at, lease_generation=3, event="session.update", update=update),
        ),
        (
            Speculate(1, "input.pause", respond=False),
            SignalCall(fence=at, lease_generation=3, event="input.pause", respond=False),
        ),
        (
            Touch(1, "playback_ack", mark),
            TouchCall(fence=at, lease_generation=3, activity="playback_ack", playback=mark),
        ),
        # a cancel opens the next epoch, at the same counters
        (
            Cancel(1, "barge_in"),
            SignalCall(
                fence=at, lease_generation=3, event="barge_in", next_fence=Fence(SID, 2, 5, 4)
            ),
        ),
        # a close and a replica are fenced at the epoch when they are made
        (
            CloseSession("client"),
            CloseCall(fence=Fence(SID, 2, 5, 4), lease_generation=3, reason="client"),
        ),
        (
            Replicate(b"state"),
            ReplicaCall(fence=Fence(SID, 2, 5, 4), lease_generation=3, state=b"state"),
        ),
    ]
    for cmd, call in cases:
        assert engine_call(cmd, At()) == call


def test_the_lease_generation_is_the_one_current_when_the_call_is_made() -> None:
    at = At()
    cmd = Commit(2, respond=True)
    at.lease_generation, at.turn_id = 4, 6  # resumed, and a commit's result came back
    call = engine_call(cmd, at)
    assert isinstance(call, CommitCall)
    assert (call.lease_generation, call.fence) == (4, Fence(SID, 2, 6, 4))


class OneCall:
    """The engine as the runtime sees it: one ``call``."""

    ready = True

    def __init__(self) -> None:
        self.made: list[ControlCall] = []

    async def session_events(self, session_id: str) -> AsyncIterator[SessionEvent]:
        return
        yield

    async def call(self, call: ControlCall) -> ControlResult:
        self.made.append(call)
        fence = Fence(SID, 2, 6, 5)
        return ControlResult(control_id=1, ok=True, session_id=SID, accepted_fence=fence)


def test_execute_returns_the_accepted_fence_but_not_for_a_close_or_replica() -> None:
    engine = OneCall()

    async def main() -> None:
        assert await execute(engine, At(), Commit(2, respond=True)) == Fence(SID, 2, 6, 5)
        assert await execute(engine, At(), CloseSession("client")) is None
        assert await execute(engine, At(), Replicate(b"s")) is None

    asyncio.run(main())
    assert [type(c) for c in engine.made] == [CommitCall, CloseCall, ReplicaCall]


def test_audio_appends_queued_behind_one_go_as_one_call() -> None:
    q = CallQueue()
    first = Append(0, audio=b"\1\0", stream_ms=0.0, seq=1)
    for cmd in (
        first,
        Append(0, audio=b"\2\0", stream_ms=20.0, seq=2),
        Append(0, audio=b"\3\0", stream_ms=40.0, seq=3),
        Append(0, text="typed"),  # not audio: stays its own call
        Append(0, audio=b"\4\0", seq=4),
    ):
        q.put_nowait(cmd)
    assert q.nbytes == 8
    merged = q.merge_appends(q.get_nowait())
    assert merged == Append(0, audio=b"\1\0\2\0\3\0", stream_ms=0.0, seq=3)
    assert q.peek() == Append(0, text="typed") and len(q) == 2


def test_appends_of_another_epoch_are_not_merged() -> None:
    q = CallQueue()
    q.put_nowait(Append(0, audio=b"\1\0"))
    q.put_nowait(Append(1, audio=b"\2\0"))
    assert q.merge_appends(q.get_nowait()) == Append(0, audio=b"\1\0") and len(q) == 1
