"""A live session's engine calls: the engine API it needs (:class:`EngineSessions`), its
one ordered mailbox of calls (:class:`CallQueue`) and the one translation of a core command
into the contract call it stands for (:func:`engine_call`), made through ``engine.call``.

Every field of a call is written once on its way: in the contract
(:mod:`duplex_contract.control`), where the engine command of the core
(:mod:`duplex_server.protocol.commands`) takes it by name; :func:`engine_call` copies it and
adds what only the runtime knows when the call is made: the fence and the lease generation.
A live session makes its calls through :class:`WithOperations`, which adds each call's
``operation_id`` (unique within the session) and, on an append or a commit, its
``expected_epoch``: a call the engine client sends again (a deadline, an engine restart)
acts once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import uuid
from collections import deque
from collections.abc import AsyncIterator
from typing import Any, Protocol

import msgspec

from duplex_contract.batch import BatchItem, BatchJob
from duplex_contract.control import AppendCall, CommitCall, ControlCall, ControlResult
from duplex_contract.fence import Fence
from duplex_contract.session_events import SessionEvent
from duplex_server.protocol.commands import (
    CORE_FIELDS,
    UNFENCED,
    Append,
    Cancel,
    EngineCommand,
)

log = logging.getLogger(__name__)


class EngineSessions(Protocol):
    """The engine API a live session uses: :class:`engine.api.client.AsyncEngine` in
    process, :class:`engine.api.remote_client.RemoteEngine` over a socket, or a test fake."""

    @property
    def ready(self) -> bool: ...

    @property
    def restarting(self) -> bool:
        """The engine process exited and comes back (its sessions kept; docs/scale.md)."""
        ...

    async def call(self, call: ControlCall) -> ControlResult:
        """Make one control call; raise its error if the engine refused it."""
        ...

    def session_events(self, session_id: str) -> AsyncIterator[SessionEvent]: ...

    def generate(self, job: BatchJob, request_id: str | None = None) -> AsyncIterator[BatchItem]:
        """Run one batch job (the words of a speech over an answer: session/speech_words.py)."""
        ...


class Position(Protocol):
    """Where the session stands when a call is made (the protocol core:
    :class:`~duplex_server.protocol.machine.SessionMachine`)."""

    @property
    def epoch(self) -> int: ...

    @property
    def lease_generation(self) -> int: ...

    def fence_for(self, epoch: int) -> Fence:
        """``epoch`` with the turn and response counters of the results so far."""
        ...


class CallQueue:
    """The session's ordered engine calls (FIFO, unbounded: its producers are bounded)."""

    def __init__(self) -> None:
        self._items: deque[EngineCommand] = deque()
        self._ready = asyncio.Event()
        self.stopped = False
        #: calls taken and not yet answered (the session's caller makes one at a time)
        self.running = 0

    def put_nowait(self, cmd: EngineCommand) -> None:
        if self.stopped:
            return  # the engine session is over: nothing to call
        self._items.append(cmd)
        self._ready.set()

    def stop(self) -> None:
        self.stopped = True
        self._items.clear()
        self._ready.set()

    async def get(self) -> EngineCommand | None:
        """The next call; None once stopped (the session's tasks are ending)."""
        while not self._items:
            if self.stopped:
                return None
            self._ready.clear()
            await self._ready.wait()
        return self._items.popleft()

    @property
    def nbytes(self) -> int:
        """Audio bytes queued for the engine (merged appends waiting their turn)."""
        return sum(len(c.audio) for c in self._items if isinstance(c, Append))

    def __len__(self) -> int:
        return len(self._items)

    def peek(self) -> EngineCommand | None:
        return self._items[0] if self._items else None

    def get_nowait(self) -> EngineCommand:
        return self._items.popleft()

    def merge_appends(self, cmd: EngineCommand) -> EngineCommand:
        """Audio appends queued behind this one (same epoch) go to the engine as one call.

        Under load the engine round trip can lag the microphone; merging keeps the queue
        short, so a barge-in or commit queued behind audio is not delayed by it.
        """
        if not isinstance(cmd, Append) or cmd.text is not None or not cmd.audio:
            return cmd
        parts, seq = [cmd.audio], cmd.seq
        while isinstance(nxt := self.peek(), Append):
            if nxt.epoch != cmd.epoch or nxt.text is not None or not nxt.audio or nxt.tool_output:
                break
            self.get_nowait()
            parts.append(nxt.audio)
            seq = nxt.seq if nxt.seq is not None else seq  # the newest input it completes
        if len(parts) == 1:
            return cmd
        return dataclasses.replace(cmd, audio=b"".join(parts), seq=seq)


def engine_call(cmd: EngineCommand, core: Position) -> ControlCall:
    """The contract call ``cmd`` stands for, fenced at the core's position now: the epoch
    the core decided (a close, a replica or items: the current one), the turn and response
    counters of the results so far, and the current lease generation."""
    epoch = core.epoch if isinstance(cmd, UNFENCED) else cmd.epoch
    fence = core.fence_for(epoch)
    fields: dict[str, Any] = {
        f.name: getattr(cmd, f.name) for f in dataclasses.fields(cmd) if f.name not in CORE_FIELDS
    }
    if isinstance(cmd, Cancel):  # the epoch it opens
        fields["next_fence"] = Fence(
            fence.session_id, cmd.epoch + 1, fence.turn_id, fence.response_seq
        )
    return cmd.CALL(fence=fence, lease_generation=core.lease_generation, **fields)


def operation_id() -> str:
    """An ``operation_id`` for a call made once (an open, a resume)."""
    return f"op-{uuid.uuid4().hex}"


def with_operation(call: ControlCall, op_id: str) -> ControlCall:
    """``call`` with its ``operation_id``; an append or a commit also expects its epoch."""
    if isinstance(call, AppendCall | CommitCall):
        return msgspec.structs.replace(call, operation_id=op_id, expected_epoch=call.fence.epoch)
    return msgspec.structs.replace(call, operation_id=op_id)


class WithOperations:
    """One session's engine, each call with an ``operation_id`` of its own (a prefix of
    the session's and a count; one the caller set is kept)."""

    def __init__(self, engine: EngineSessions) -> None:
        self.engine = engine
        self._prefix = uuid.uuid4().hex[:12]
        self._count = itertools.count(1)

    @property
    def ready(self) -> bool:
        return self.engine.ready

    @property
    def restarting(self) -> bool:
        return self.engine.restarting

    async def call(self, call: ControlCall) -> ControlResult:
        if call.operation_id is None:
            call = with_operation(call, f"op-{self._prefix}-{next(self._count)}")
        return await self.engine.call(call)

    def session_events(self, session_id: str) -> AsyncIterator[SessionEvent]:
        return self.engine.session_events(session_id)

    def generate(self, job: BatchJob, request_id: str | None = None) -> AsyncIterator[BatchItem]:
        return self.engine.generate(job, request_id)


async def execute(engine: EngineSessions, core: Position, cmd: EngineCommand) -> Fence | None:
    """Make the engine call ``cmd`` stands for; the fence the engine accepted (None for a
    close, a replica or items, which move no counter)."""
    res = await engine.call(engine_call(cmd, core))
    return None if isinstance(cmd, UNFENCED) else res.accepted_fence
