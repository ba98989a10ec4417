"""The vLLM stages' private event loop (engine/stages/vllm_engine.py): the thread it runs in,
and the per-request stream that carries outputs from that loop back to the orchestrator's."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from duplex_contract.errors import StageError
from engine.messages import StageDone, StageOutput

log = logging.getLogger(__name__)

_END = object()  # a stream is over


@dataclass(eq=False)
class RequestStream:
    """One request's outputs, from the vLLM loop's thread to the orchestrator's loop.

    The vLLM thread calls ``deliver``, ``fail`` and ``finish``; the orchestrator's loop
    ``end`` (an abort or close: the stream ends at once, anything later is dropped) and reads
    ``outputs()``."""

    request_id: str
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    tokens: int = 0  # written by the vLLM thread, read by the orchestrator loop
    ended: bool = False  # orchestrator loop only

    def _put(self, item: object) -> None:
        try:
            self.loop.call_soon_threadsafe(self.out.put_nowait, item)
        except RuntimeError:  # the orchestrator loop is closed: nobody listens any more
            pass

    def deliver(self, item: StageOutput | StageError) -> None:
        """One output, or the request's error (any thread but the orchestrator's)."""
        self._put(item)

    def fail(self, error: StageError) -> None:
        """The request failed with ``error`` (any thread but the orchestrator's)."""
        self._put(error)
        self._put(_END)

    def finish(self) -> None:
        """Nothing more comes (the vLLM thread)."""
        self._put(_END)

    def end(self, last: StageDone) -> None:
        """End the stream now with ``last`` (orchestrator loop); later outputs are dropped."""
        if not self.ended:
            self.ended = True
            self.out.put_nowait(last)
            self.out.put_nowait(_END)

    async def outputs(self) -> AsyncIterator[StageOutput]:
        """The outputs up to the first ``StageDone``; an error delivered is raised."""
        while True:
            item = await self.out.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            if self.ended and not isinstance(item, StageDone):
                continue  # aborted: never forward another chunk
            yield item
            if isinstance(item, StageDone):
                return


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


__all__ = ["RequestStream", "run_loop"]
