"""The in-process engine's transport: the orchestrator thread and the janus queues between it
and the server's event loop (:class:`InProcessLink`; engine/api/client.py's
:class:`~engine.api.client.AsyncEngine` holds it).

Three janus queues connect the loop to the orchestrator thread: requests (server ->
engine), outputs (session events and batch items: one put per orchestrator loop iteration,
a list when it emitted several, engine/orchestration/output_router.py's ``OutputBatch``) and
rpc (control results); one router task per incoming queue hands each message to the
client's :class:`EngineInbox`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import janus

from engine.api.inbox import EngineInbox
from engine.config import EngineConfig
from engine.messages import EngineOutput, EngineRequest, ShutdownRequest
from engine.orchestration.orchestrator import Orchestrator
from engine.spans import EngineTracing
from engine.stages.base import StageBackend

log = logging.getLogger(__name__)


class InProcessLink:
    """The orchestrator thread and its queues; made by :meth:`start`, ended by :meth:`close`."""

    def __init__(
        self,
        inbox: EngineInbox,
        orchestrator: Orchestrator,
        requests: janus.SyncQueue[EngineRequest],
        out: janus.Queue[EngineOutput | list[EngineOutput]],
        rpc: janus.Queue[Any],
        thread: threading.Thread,
        thread_done: asyncio.Future[None],
    ) -> None:
        self.inbox = inbox
        self.orchestrator = orchestrator
        self._requests = requests
        self._out = out  # session events, batch items and the fatal error (lists: batches)
        self._rpc = rpc  # control results and the fatal error
        self._thread = thread
        self._thread_done: asyncio.Future[None] | None = thread_done
        self._routers = [
            asyncio.create_task(self._route(rpc), name="engine-rpc-router"),
            asyncio.create_task(self._route(out), name="engine-output-router"),
        ]
        self._open = True

    @classmethod
    async def start(
        cls,
        config: EngineConfig,
        backends: Mapping[str, Sequence[StageBackend]] | None,
        tracing: EngineTracing,
        inbox: EngineInbox,
    ) -> InProcessLink:
        """Start the orchestrator thread and wait until its stages have loaded."""
        out: janus.Queue[EngineOutput | list[EngineOutput]] = janus.Queue()
        rpc: janus.Queue[Any] = janus.Queue()
        orch = Orchestrator(config, out.sync_q, rpc.sync_q, backends, tracing)
        thread, done = _run_in_thread(orch)
        try:
            requests = await asyncio.wrap_future(orch.started)
        except BaseException:
            await done
            await _close_queues(out, rpc)
            raise
        return cls(inbox, orch, requests, out, rpc, thread, done)

    async def _route(self, queue: janus.Queue[Any]) -> None:
        q, inbox = queue.async_q, self.inbox
        while True:
            put = await q.get()
            if isinstance(put, list):  # one loop iteration's outputs (OutputBatch)
                for msg in put:
                    inbox.receive(msg)
            else:
                inbox.receive(put)

    @property
    def open(self) -> bool:
        return self._open

    def send(self, msg: EngineRequest) -> None:
        """Queue one request for the orchestrator; RuntimeError once it is gone."""
        self._requests.put_nowait(msg)

    def backlog(self) -> int:
        """Requests waiting for the orchestrator."""
        return self._requests.qsize()

    def output_backlog(self) -> int:
        """Session events and batch items waiting for the router."""
        return self._out.sync_q.qsize()

    async def close(self) -> None:
        """Stop the orchestrator and its routers; safe to call twice."""
        if self._thread_done is None:
            return
        self._open = False
        if not self._thread_done.done():
            try:
                self._requests.put_nowait(ShutdownRequest())
            except RuntimeError:
                pass
            try:
                await asyncio.wait_for(asyncio.shield(self._thread_done), 15.0)
            except TimeoutError:
                log.error("orchestrator did not stop within 15 s")
        self._thread.join(timeout=1.0)
        for task in self._routers:
            task.cancel()
        await asyncio.gather(*self._routers, return_exceptions=True)
        self._routers = []
        await _close_queues(self._out, self._rpc)
        self._thread_done = None


def _run_in_thread(orch: Orchestrator) -> tuple[threading.Thread, asyncio.Future[None]]:
    """Run the orchestrator on its own thread; the future is done when the thread ends."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def finished() -> None:
        if not done.done():
            done.set_result(None)

    def main() -> None:
        try:
            orch.run()
        finally:
            try:
                loop.call_soon_threadsafe(finished)
            except RuntimeError:
                pass

    thread = threading.Thread(target=main, name="engine-orchestrator", daemon=True)
    thread.start()
    return thread, done


async def _close_queues(*queues: janus.Queue[Any]) -> None:
    for q in queues:
        q.close()
        await q.wait_closed()
