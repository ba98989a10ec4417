"""The typed control calls of the engine client (open, append, commit, signal, touch,
resume, close), each one :meth:`EngineClientCore.call`; :class:`engine.api.client.AsyncEngine`
builds on them."""

from __future__ import annotations

from duplex_contract.control import (
    Activity,
    AppendCall,
    CloseCall,
    CommitCall,
    ControlResult,
    OpenCall,
    PlaybackMark,
    ReplicaCall,
    ResumeCall,
    SignalCall,
    SignalEvent,
    TouchCall,
)
from duplex_contract.fence import Fence
from duplex_contract.settings import SessionSettings, SessionUpdate
from duplex_contract.tools import ItemRef, ResponseOptions, ToolOutput
from engine.api.client_core import EngineClientCore


class EngineCalls(EngineClientCore):
    """One method per control call; each raises the call's error if ``ok`` is False."""

    async def open(
        self,
        config: SessionSettings | None = None,
        *,
        route_key: str | None = None,
        traceparent: str | None = None,
    ) -> ControlResult:
        call = OpenCall(
            config=config or SessionSettings(), route_key=route_key, traceparent=traceparent
        )
        res = await self.call(call)
        assert res.session_id is not None
        self._mailbox(res.session_id)
        return res

    async def append(
        self,
        fence: Fence,
        lease_generation: int,
        *,
        audio: bytes = b"",
        text: str | None = None,
        seq: int | None = None,
        operation_id: str | None = None,
        expected_epoch: int | None = None,
        item_id: str | None = None,
        tool_output: ToolOutput | None = None,
        stream_ms: float | None = None,
    ) -> ControlResult:
        return await self.call(
            AppendCall(
                fence=fence,
                lease_generation=lease_generation,
                audio=audio,
                text=text,
                seq=seq,
                operation_id=operation_id,
                expected_epoch=expected_epoch,
                item_id=item_id,
                tool_output=tool_output,
                stream_ms=stream_ms,
            )
        )

    async def commit(
        self,
        fence: Fence,
        lease_generation: int,
        *,
        respond: bool = True,
        operation_id: str | None = None,
        item_id: str | None = None,
        response: ResponseOptions | None = None,
        traceparent: str | None = None,
    ) -> ControlResult:
        return await self.call(
            CommitCall(
                fence=fence,
                lease_generation=lease_generation,
                respond=respond,
                operation_id=operation_id,
                item_id=item_id,
                response=response,
                traceparent=traceparent,
            )
        )

    async def signal(
        self,
        fence: Fence,
        lease_generation: int,
        event: SignalEvent,
        *,
        next_fence: Fence | None = None,
        update: SessionUpdate | None = None,
        operation_id: str | None = None,
        item: ItemRef | None = None,
        respond: bool = True,
        traceparent: str | None = None,
    ) -> ControlResult:
        return await self.call(
            SignalCall(
                fence=fence,
                lease_generation=lease_generation,
                event=event,
                next_fence=next_fence,
                update=update,
                operation_id=operation_id,
                item=item,
                respond=respond,
                traceparent=traceparent,
            )
        )

    async def touch(
        self,
        fence: Fence,
        lease_generation: int,
        activity: Activity,
        *,
        playback: PlaybackMark | None = None,
    ) -> ControlResult:
        return await self.call(
            TouchCall(
                fence=fence, lease_generation=lease_generation, activity=activity, playback=playback
            )
        )

    async def resume(
        self, session_id: str, expected_lease_generation: int, *, peek: bool = False
    ) -> ControlResult:
        """Renew the lease (compare and swap); ``peek``: change nothing, return the lease
        generation, the front end's replica and the engine's input seq."""
        return await self.call(
            ResumeCall(
                session_id=session_id,
                expected_lease_generation=expected_lease_generation,
                peek=peek,
            )
        )

    async def replicate(self, fence: Fence, lease_generation: int, state: bytes) -> ControlResult:
        """Keep the front end's state of a session in the engine (engine/duplex/replica.py)."""
        return await self.call(
            ReplicaCall(fence=fence, lease_generation=lease_generation, state=state)
        )

    async def close(
        self, fence: Fence, lease_generation: int, reason: str = "client"
    ) -> ControlResult:
        return await self.call(
            CloseCall(fence=fence, lease_generation=lease_generation, reason=reason)
        )
