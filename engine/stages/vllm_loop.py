"""The vLLM stages' private event loop (engine/stages/llm_vllm.py): the thread it runs in,
and the per-request job that carries outputs from that loop back to the orchestrator's."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from dataclasses import dataclass, field
from typing import Any, Literal

log = logging.getLogger(__name__)

FinishReason = Literal["stop", "length", "aborted"]
_END = object()  # a job's stream is over


@dataclass(eq=False)
class _Job:
    request_id: str
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    tokens: int = 0  # written by the vLLM thread, read by the orchestrator loop
    ended: bool = False  # orchestrator loop only

    def deliver(self, item: object) -> None:
        """Called from the vLLM thread."""
        try:
            self.loop.call_soon_threadsafe(self.out.put_nowait, item)
        except RuntimeError:  # the orchestrator loop is closed: nobody listens any more
            pass


def run_loop(ready: concurrent.futures.Future[asyncio.AbstractEventLoop], name: str) -> None:
    """A thread's main: a new event loop, handed to ``ready``, run until stopped; then every
    task left on it is cancelled and the loop closed."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    ready.set_result(loop)
    try:
        loop.run_forever()
    finally:
        try:
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        except Exception:
            log.exception("%s: vLLM loop cleanup failed", name)
        loop.close()


__all__ = ["FinishReason", "run_loop"]
