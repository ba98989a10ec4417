"""A live session's engine calls: the engine API it needs (:class:`EngineSessions`), its
one ordered mailbox of calls (:class:`CallQueue`) and the translation of a core command into
an engine call (:func:`execute`)."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator
from typing import Protocol

from duplex_contract.control import Activity, ControlResult, PlaybackMark, SignalEvent
from duplex_contract.events import SessionEvent
from duplex_contract.fence import Fence
from duplex_contract.settings import SessionSettings, SessionUpdate
from duplex_contract.tools import ItemRef, ResponseOptions, ToolOutput
from duplex_server.protocol.commands import (
    Append,
    Cancel,
    CloseSession,
    Commit,
    DeleteItem,
    EngineCommand,
    Replicate,
    Speculate,
    Update,
)
from duplex_server.protocol.machine import SessionMachine

log = logging.getLogger(__name__)


class EngineSessions(Protocol):
    """The engine calls a live session makes: :class:`engine.api.client.AsyncEngine` in
    process, or any front end of an engine in another process that speaks the same calls."""

    @property
    def ready(self) -> bool: ...

    async def open(
        self,
        config: SessionSettings | None = None,
        *,
        route_key: str | None = None,
        traceparent: str | None = None,
    ) -> ControlResult: ...

    async def resume(
        self, session_id: str, expected_lease_generation: int, *, peek: bool = False
    ) -> ControlResult: ...

    async def append(
        self,
        fence: Fence,
        lease_generation: int,
        *,
        audio: bytes = b"",
        text: str | None = None,
        item_id: str | None = None,
        tool_output: ToolOutput | None = None,
        stream_ms: float | None = None,
        seq: int | None = None,
    ) -> ControlResult: ...

    async def commit(
        self,
        fence: Fence,
        lease_generation: int,
        *,
        respond: bool = True,
        item_id: str | None = None,
        response: ResponseOptions | None = None,
        traceparent: str | None = None,
    ) -> ControlResult: ...

    async def signal(
        self,
        fence: Fence,
        lease_generation: int,
        event: SignalEvent,
        *,
        next_fence: Fence | None = None,
        update: SessionUpdate | None = None,
        item: ItemRef | None = None,
        respond: bool = True,
        traceparent: str | None = None,
    ) -> ControlResult: ...

    async def touch(
        self,
        fence: Fence,
        lease_generation: int,
        activity: Activity,
        *,
        playback: PlaybackMark | None = None,
    ) -> ControlResult: ...

    async def close(
        self, fence: Fence, lease_generation: int, reason: str = "client"
    ) -> ControlResult: ...

    async def replicate(
        self, fence: Fence, lease_generation: int, state: bytes
    ) -> ControlResult: ...

    def session_events(self, session_id: str) -> AsyncIterator[SessionEvent]: ...


class CallQueue:
    """The session's ordered engine calls (FIFO, unbounded: its producers are bounded)."""

    def __init__(self) -> None:
        self._items: deque[EngineCommand] = deque()
        self._ready = asyncio.Event()
        self.stopped = False

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
        return Append(
            cmd.epoch,
            audio=b"".join(parts),
            event_id=cmd.event_id,
            stream_ms=cmd.stream_ms,
            seq=seq,
        )


async def execute(engine: EngineSessions, core: SessionMachine, cmd: EngineCommand) -> Fence | None:
    """Make the engine call ``cmd`` stands for, fenced at the core's position."""
    eng = engine
    gen = core.lease_generation
    if isinstance(cmd, CloseSession):
        await eng.close(core.fence_for(core.epoch), gen, reason=cmd.reason)
        return None
    if isinstance(cmd, Replicate):
        await eng.replicate(core.fence_for(core.epoch), gen, cmd.state)
        return None
    fence = core.fence_for(cmd.epoch)
    if isinstance(cmd, Append):
        res = await eng.append(
            fence,
            gen,
            audio=cmd.audio,
            text=cmd.text,
            item_id=cmd.item_id,
            tool_output=cmd.tool_output,
            stream_ms=cmd.stream_ms,
            seq=cmd.seq,
        )
    elif isinstance(cmd, Commit):
        res = await eng.commit(
            fence,
            gen,
            respond=cmd.respond,
            item_id=cmd.item_id,
            response=cmd.response,
            traceparent=cmd.traceparent,
        )
    elif isinstance(cmd, DeleteItem):
        res = await eng.signal(fence, gen, "item.delete", item=cmd.item)
    elif isinstance(cmd, Cancel):
        nxt = Fence(fence.session_id, cmd.epoch + 1, fence.turn_id, fence.response_seq)
        res = await eng.signal(fence, gen, cmd.event, next_fence=nxt)
    elif isinstance(cmd, Speculate):
        res = await eng.signal(
            fence, gen, cmd.event, respond=cmd.respond, traceparent=cmd.traceparent
        )
    elif isinstance(cmd, Update):
        upd = SessionUpdate.replace_with(cmd.settings)
        res = await eng.signal(fence, gen, "session.update", update=upd)
    else:
        mark = None
        if cmd.activity == "playback_ack":
            mark = PlaybackMark(cmd.turn_id, cmd.response_seq, cmd.played_ms, cmd.truncate)
        res = await eng.touch(fence, gen, cmd.activity, playback=mark)
    return res.accepted_fence
