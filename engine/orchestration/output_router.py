"""The orchestrator's output queue: session events routed by session, output of a stale
fence dropped before it is routed, batch outputs and lifecycle events put as they are."""

from __future__ import annotations

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


class OutputRouter:
    """Puts the engine's outputs on the output queue with ``put`` (its ``put_nowait``; one
    put per item: batching per loop iteration was measured to raise the per-chunk latency,
    p50 0.38 -> 0.55 ms at 32 sessions, without raising server capacity).
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
