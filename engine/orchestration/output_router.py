"""The orchestrator's output queue: session events routed by session, output of a stale
fence dropped before it is routed, batch outputs and lifecycle events put as they are."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

from duplex_contract.fence import Fence
from duplex_contract.session_events import SessionEvent, SessionLifecycle
from engine.messages import EngineOutput, SessionOutput
from engine.orchestration.counters import Counters


class Emit(Protocol):
    """Route one session event (``final``: a done that ends a cancelled response, routed
    even though its fence is no longer the session's)."""

    def __call__(self, sid: str, event: SessionEvent, *, final: bool = False) -> None: ...


class OutputBatch:
    """The output queue's ``put`` for the orchestrator's loop: the outputs of one loop
    iteration go on the queue as one put, in order (a list when there are several), so the
    server's loop is woken once per iteration instead of once per output (each janus put
    from this thread is a ``call_soon_threadsafe``: a self-pipe write and a wake-up of the
    other loop). The reader unpacks the lists. :meth:`flush` puts what is
    pending now: before a control result goes on the other queue, so that outputs emitted
    before it are not read after it, and when the loop is gone."""

    def __init__(self, put: Callable[[EngineOutput | list[EngineOutput]], None]) -> None:
        self._put = put
        self._pending: list[EngineOutput] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    def __call__(self, output: EngineOutput) -> None:
        if not self._pending:
            if self._loop is None:
                self._loop = asyncio.get_running_loop()
            self._loop.call_soon(self.flush)
        self._pending.append(output)

    def flush(self) -> None:
        """Put what is pending (nothing if nothing is)."""
        if not self._pending:
            return
        batch, self._pending = self._pending, []
        self._put(batch[0] if len(batch) == 1 else batch)


class OutputRouter:
    """Puts the engine's outputs on the output queue with ``put`` (an :class:`OutputBatch`
    in the orchestrator: one put per loop iteration).
    ``is_current(fence)``: the control plane's word on whether a fence is still the
    session's."""

    def __init__(
        self,
        put: Callable[[EngineOutput], None],
        is_current: Callable[[Fence], bool],
        counters: Counters,
    ) -> None:
        self._put = put
        self._is_current = is_current
        self._counters = counters

    def emit(self, sid: str, event: SessionEvent, *, final: bool = False) -> None:
        """Route one session event; stale-fence output is dropped (a final done is not)."""
        fence = None if isinstance(event, SessionLifecycle) else event.fence
        if fence is not None and not final and not self._is_current(fence):
            self._counters.stale_dropped += 1
            return
        self._put(SessionOutput(session_id=sid, event=event))

    def put(self, output: EngineOutput) -> None:
        """Put an output as it is (the control plane's events, batch outputs)."""
        self._put(output)
