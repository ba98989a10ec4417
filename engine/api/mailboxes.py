"""Where the engine's session events and batch items wait for their readers.

One mailbox per session: its events wait there while nobody reads, so a consumer that stops
(a dropped socket) and a new one (the resumed socket) see one unbroken stream; the stream
ends after the session's ``SessionLifecycle(state="closed")``. One mailbox per running batch
job. The engine's death (:meth:`Mailboxes.end`) ends every stream with its error (a session
stream that already saw its close just ends), and a mailbox made after it gets the error at
once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Final

from duplex_contract.errors import EngineDeadError
from duplex_contract.session_events import SessionEvent, SessionLifecycle
from engine.messages import BatchOutput, SessionOutput


class _Closed:
    """The end of a session's stream (after its closed lifecycle event)."""


CLOSED: Final = _Closed()

SessionItem = SessionEvent | _Closed | EngineDeadError
BatchItem = BatchOutput | EngineDeadError


class Mailboxes:
    """The session and batch mailboxes of one engine client."""

    def __init__(self) -> None:
        self._sessions: dict[str, asyncio.Queue[SessionItem]] = {}
        self._batches: dict[str, asyncio.Queue[BatchItem]] = {}
        self._ended: EngineDeadError | None = None

    # ------------------------------------------------------------------ sessions
    def open_session(self, session_id: str) -> asyncio.Queue[SessionItem]:
        """The session's mailbox, made if it has none (its events wait there)."""
        box = self._sessions.get(session_id)
        if box is None:
            box = self._sessions[session_id] = asyncio.Queue()
            if self._ended is not None:
                box.put_nowait(self._ended)
        return box

    async def session_events(self, session_id: str) -> AsyncIterator[SessionEvent]:
        """The session's events; ends after its closed event, raises the engine's death."""
        box = self.open_session(session_id)
        closed = False
        while True:
            item = await box.get()
            if isinstance(item, _Closed | EngineDeadError):
                if self._sessions.get(session_id) is box:
                    del self._sessions[session_id]
                if isinstance(item, EngineDeadError) and not closed:
                    raise item
                return
            if isinstance(item, SessionLifecycle) and item.state == "closed":
                closed = True
            yield item

    def has_session(self, session_id: str) -> bool:
        """Is the session's stream still open (its events still wanted)?"""
        return session_id in self._sessions

    def lose(self, session_id: str, exc: EngineDeadError) -> None:
        """This one session is gone with the engine (a restarted engine did not have it):
        its stream ends with ``exc``."""
        box = self._sessions.get(session_id)
        if box is not None:
            box.put_nowait(exc)

    def end_batches(self, exc: EngineDeadError) -> None:
        """Every running batch job fails with ``exc`` (the engine restarts: they are lost);
        the session streams go on."""
        for bbox in self._batches.values():
            bbox.put_nowait(exc)

    # ------------------------------------------------------------------ batch jobs
    def open_batch(self, request_id: str) -> None:
        box: asyncio.Queue[BatchItem] = asyncio.Queue()
        if self._ended is not None:
            box.put_nowait(self._ended)
        self._batches[request_id] = box

    async def batch_output(self, request_id: str) -> BatchOutput:
        """The job's next output; raises the engine's death."""
        item = await self._batches[request_id].get()
        if isinstance(item, EngineDeadError):
            raise item
        return item

    def close_batch(self, request_id: str) -> bool:
        """Forget the job's mailbox; False if it had none (already closed)."""
        return self._batches.pop(request_id, None) is not None

    # ------------------------------------------------------------------ routing
    def deliver(self, out: SessionOutput | BatchOutput) -> None:
        """One session event or batch item from the engine, to its reader's mailbox (a
        batch item of a job nobody waits for any more is dropped)."""
        if isinstance(out, BatchOutput):
            box = self._batches.get(out.request_id)
            if box is not None:
                box.put_nowait(out)
            return
        mailbox = self.open_session(out.session_id)
        mailbox.put_nowait(out.event)
        if isinstance(out.event, SessionLifecycle) and out.event.state == "closed":
            mailbox.put_nowait(CLOSED)

    def end(self, exc: EngineDeadError) -> None:
        """The engine is gone: every stream, and every later mailbox, ends with ``exc``."""
        if self._ended is None:
            self._ended = exc
        for box in self._sessions.values():
            box.put_nowait(self._ended)
        for bbox in self._batches.values():
            bbox.put_nowait(self._ended)
