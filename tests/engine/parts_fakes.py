"""Small fakes for the orchestrator's parts' unit tests (engine/orchestration/): a real
session, an output recorder, and the narrow sides of the parts a part talks to."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from duplex_contract.fence import Fence
from duplex_contract.session_events import SessionEvent
from duplex_contract.settings import SessionSettings
from engine.duplex.lease import Lease
from engine.duplex.session import DuplexSession, TurnJob
from engine.orchestration.history import ConversationHistory


def session(sid: str = "sess_a", epoch: int = 0, **settings: Any) -> DuplexSession:
    """A real open session (its fence ``(sid, epoch, 0, 0)``)."""
    return DuplexSession(
        session_id=sid,
        config=SessionSettings(**settings),
        fence=Fence(sid, epoch, 0, 0),
        lease=Lease(created_at=0.0, last_activity=0.0),
        history=ConversationHistory(6000),
    )


def job(fence: Fence, text: str = "", audio: bytes = b"", respond: bool = True) -> TurnJob:
    """A committed turn: ``text`` as one text item (as the control plane makes it)."""
    items = ((None, text),) if text else ()
    return TurnJob(fence=fence, audio=audio, text=text, respond=respond, items=items)


class Emitted:
    """Records what a part emits: ``(sid, event, final)``."""

    def __init__(self) -> None:
        self.out: list[tuple[str, SessionEvent, bool]] = []

    def __call__(self, sid: str, event: SessionEvent, *, final: bool = False) -> None:
        self.out.append((sid, event, final))

    def events(self) -> list[SessionEvent]:
        return [e for _, e, _ in self.out]


class Calls:
    """Any method call is recorded as ``(name, *args)``; ``returns`` gives results."""

    def __init__(self, log: list[tuple[Any, ...]] | None = None, **returns: Any) -> None:
        self.log = [] if log is None else log
        self._returns = returns

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any, **kw: Any) -> Any:
            self.log.append((name, *args))
            return self._returns.get(name)

        return call


class Tracing:
    """EngineTracing's side the turn runner and clean-up use, recording."""

    def __init__(self) -> None:
        self.closed: list[str] = []

    @contextmanager
    def turn(self, traceparent: str | None) -> Iterator[None]:
        yield

    def session_closed(self, sid: str) -> None:
        self.closed.append(sid)


class Pool:
    """A stage pool's abort and clean-up side: ``running`` request ids on replica 0;
    aborts wait for ``gate``."""

    def __init__(self, *running: str) -> None:
        self.running = list(running)
        self.aborted: list[str] = []
        self.released: list[str] = []
        self.gate = asyncio.Event()
        self.gate.set()

    def locate_prefix(self, prefix: str) -> list[tuple[int, list[str]]]:
        ids = [r for r in self.running if r.startswith(prefix)]
        return [(0, ids)] if ids else []

    def release_session(self, session_id: str) -> None:
        self.released.append(session_id)

    async def abort_located(self, located: Sequence[tuple[int, list[str]]]) -> None:
        await self.gate.wait()
        for _, ids in located:
            self.aborted += ids
            self.running = [r for r in self.running if r not in ids]


async def settle(rounds: int = 5) -> None:
    """Let the loop run the callbacks and steps that are ready."""
    for _ in range(rounds):
        await asyncio.sleep(0)
