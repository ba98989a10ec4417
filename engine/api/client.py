"""The engine's clients in the server's event loop (see docs/engine.md): :class:`EngineClient`,
what both are, and :class:`AsyncEngine`, the engine in this process.

A client is three parts it holds, each with one job: its :class:`~engine.api.inbox.EngineInbox`
(control-call waiters, session and batch mailboxes, the engine's death), its link, the
transport to the engine (:class:`EngineLink`: janus queues to the orchestrator thread,
engine/api/inprocess.py, or a socket to an engine process, engine/api/remote_client.py), and
its :class:`Figures`. Every control call goes through one method, :meth:`EngineClient.call`,
with a struct of :mod:`duplex_contract.control`; a fatal engine error fails every pending and
later call and every stream with :class:`EngineDeadError`, whatever the transport.

Retries: a call that carries an ``operation_id`` and gets no answer within
``control_timeout_s`` is sent once more with the same id (the engine answers a repeat with
its first answer, so it acts once), then fails with ``deadline_exceeded``. A client whose
engine comes back after it exits (:class:`~engine.api.remote_client.RemoteEngine` of an
engine with a session store) holds its calls while the engine is away and sends the one in
flight again once it is back (:class:`~engine.api.waiters.LinkLost`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from opentelemetry.trace import Tracer

from duplex_contract.batch import BatchDone, BatchItem, BatchJob
from duplex_contract.control import ControlCall, ControlResult, OpenCall
from duplex_contract.errors import ControlError, EngineDeadError
from duplex_contract.session_events import SessionEvent
from engine.api.inbox import EngineInbox
from engine.api.inprocess import InProcessLink
from engine.api.waiters import LinkLost
from engine.config import EngineConfig
from engine.messages import (
    AbortRequest,
    ControlRequest,
    DetachRequest,
    EngineRequest,
    GenerateRequest,
)
from engine.orchestration.orchestrator import Orchestrator
from engine.orchestration.speculation import SpeculativeAsr
from engine.spans import EngineTracing
from engine.stage_figures import SchedulingFigures, StageEngineFigures, stage_engine_figures
from engine.stages.base import StageBackend


@dataclass(frozen=True)
class EngineStats:
    sessions: dict[str, int]
    admissions: dict[str, int]
    stale_chunks_dropped: int
    request_queue_depth: int
    output_queue_depth: int
    pending_calls: int
    stage_restarts: dict[str, int]
    # stages with no live replica (each reports itself down: a remote stage whose circuit
    # is open, a dead EngineCore): why
    stages_down: dict[str, str] = field(default_factory=dict)
    # replicas down while their stage has a live one (/health: 200 degraded): why
    replicas_down: dict[str, str] = field(default_factory=dict)
    # bytes the engine holds for its sessions, by part (engine_input, history, speculation)
    session_bytes: dict[str, int] = field(default_factory=dict)
    # speculative responses (engine/orchestration/drafts.py) by outcome: started, used, dropped
    speculative_responses: dict[str, int] = field(default_factory=dict)
    # speculative transcripts of pauses (engine/orchestration/speculation.py): started, skipped,
    # used
    speculative_transcripts: dict[str, int] = field(default_factory=dict)
    # what the stages' own engines report (vLLM: running/waiting, KV cache use, tokens)
    stage_engines: dict[str, StageEngineFigures] = field(default_factory=dict)
    # the scheduling policy's state per stage (engine/orchestration/scheduling.py)
    scheduling: dict[str, SchedulingFigures] = field(default_factory=dict)


class EngineLink(Protocol):
    """The transport to the engine. What comes back goes to the client's inbox."""

    @property
    def open(self) -> bool:
        """False once closed or lost."""
        ...

    def send(self, msg: EngineRequest) -> None:
        """Send one request now (requests keep their order); RuntimeError once the engine
        is gone."""
        ...

    def backlog(self) -> int:
        """What waits to reach the engine (requests, or bytes on a socket)."""
        ...

    async def close(self) -> None:
        """End the link; safe to call twice."""
        ...


class Comeback(Protocol):
    """A link whose engine may go away and come back (engine/api/remote_client.py's
    ``ReconnectingLink``): calls wait for it, and it keeps what it needs to take the
    sessions back."""

    @property
    def restarting(self) -> bool:
        """The engine went away and comes back: calls wait (:meth:`until_back`)."""
        ...

    async def until_back(self) -> None:
        """Return once calls can be sent (at once, unless the engine is coming back)."""
        ...

    def answered(self, call: ControlCall, result: ControlResult) -> None:
        """A call succeeded: keep what taking the sessions back needs of it."""
        ...


class Figures(Protocol):
    """The engine's figures: read off the orchestrator, or as an engine process pushed them."""

    def stats(self) -> EngineStats:
        """Engine-wide figures (``pending_calls`` is the client's own: filled in by it)."""
        ...

    def drain_stage_latencies(self) -> list[tuple[str, float]]:
        """(stage, seconds to first output) of each stage request since the last drain."""
        ...

    def drain_stage_steps(self) -> list[tuple[str, int]]:
        """(stage, batch size) of each step the batching stages ran since the last drain."""
        ...

    def drain_stage_waits(self) -> list[tuple[str, float]]:
        """(stage, seconds from submit to the start of its work) since the last drain."""
        ...

    def drain_stage_decodes(self) -> list[tuple[str, float, float]]:
        """(stage, decoder seconds, audio seconds) of each decoder step since the last drain."""
        ...


class EngineClient:
    """The engine's API in the server's loop, over any link (see the module docstring)."""

    def __init__(
        self,
        config: EngineConfig,
        inbox: EngineInbox,
        link: EngineLink,
        figures: Figures,
        comeback: Comeback | None = None,
    ) -> None:
        self.config = config
        self.inbox = inbox
        self.link = link
        self.figures = figures
        #: the link's engine may come back after it exits (None: its death is final)
        self.comeback = comeback
        self._shutdown_lock = asyncio.Lock()

    @property
    def ready(self) -> bool:
        return self.link.open and self.inbox.dead is None

    @property
    def restarting(self) -> bool:
        """The engine process exited and this client waits for it to come back (its
        sessions kept: engine/api/remote_client.py); never for the in-process engine."""
        return self.comeback is not None and self.comeback.restarting

    def _link_failed(self, why: str) -> None:
        """Sending failed: the link is gone; the engine too, unless it is coming back."""
        if not self.restarting:
            self.inbox.die(EngineDeadError(f"engine stopped: {why}"))

    def on_dead(self, hook: Callable[[EngineDeadError], None]) -> None:
        """Call ``hook`` (on this loop) once, when the engine dies or is shut down."""
        self.inbox.on_dead(hook)

    # ------------------------------------------------------------------ control calls
    def submit(self, call: ControlCall) -> asyncio.Future[ControlResult]:
        """Send one control call now (calls keep their order); its result arrives on the
        future, ``ok`` False included. Raises :class:`EngineDeadError` if the engine is gone."""
        if self.inbox.dead is not None:
            raise self.inbox.dead
        cid, fut = self.inbox.waiters.add()
        try:
            self.link.send(ControlRequest(control_id=cid, call=call))
        except RuntimeError as exc:  # the link is gone: the future fails with it
            self._link_failed(str(exc))
            if not fut.done():
                fut.set_exception(LinkLost(str(exc)))
        return fut

    async def call(self, call: ControlCall, wait_s: float | None = None) -> ControlResult:
        """Make one control call; raise its error if ``ok`` is False. An opened session's
        mailbox exists from then on (its events wait there until someone reads them).
        A call with an ``operation_id`` is sent once more after a deadline, and again
        after an engine restart (the module docstring)."""
        retried = False
        while True:
            if self.comeback is not None:
                await self.comeback.until_back()  # at once, unless the engine comes back
            fut = self.submit(call)
            try:
                # not asyncio.wait_for: on Python 3.11 it swallows a cancellation that arrives
                # as the result does, and a session's caller cancelled then never ended (its
                # session stayed live in the front end for good)
                async with asyncio.timeout(wait_s or self.config.control_timeout_s):
                    res = await fut
            except TimeoutError:
                if retried or call.operation_id is None:
                    raise ControlError(
                        "engine did not answer in time", code="deadline_exceeded"
                    ) from None
                retried = True  # the same id: the engine acts on it once
                continue
            except LinkLost:
                continue  # the engine restarts: once it is back, the same call again
            break
        if not res.ok:
            assert res.error is not None
            raise res.error.to_exc()
        if isinstance(call, OpenCall):
            assert res.session_id is not None
            self.inbox.mailboxes.open_session(res.session_id)
        if self.comeback is not None:
            self.comeback.answered(call, res)
        return res

    # ------------------------------------------------------------------ streams
    def session_events(self, session_id: str) -> AsyncIterator[SessionEvent]:
        """Typed events of one session; ends after SessionLifecycle(state='closed').

        Events wait in the session's mailbox while nobody iterates, so a consumer that
        stops (a dropped socket) and a new one (the resumed socket) see one unbroken stream.
        """
        return self.inbox.mailboxes.session_events(session_id)

    async def generate(
        self, job: BatchJob, request_id: str | None = None
    ) -> AsyncIterator[BatchItem]:
        """Run one batch job; yields its items and ends after BatchDone."""
        rid = request_id or f"req_{uuid.uuid4().hex}"
        boxes = self.inbox.mailboxes
        boxes.open_batch(rid)
        try:
            self._send(GenerateRequest(request_id=rid, job=job))
            while True:
                out = await boxes.batch_output(rid)
                if out.error is not None:
                    raise out.error.to_exc()
                assert out.item is not None
                yield out.item
                if isinstance(out.item, BatchDone):
                    return
        finally:
            if boxes.close_batch(rid) and self.inbox.dead is None and self.link.open:
                self._send(AbortRequest(request_id=rid))

    async def abort(self, request_id: str) -> None:
        self._send(AbortRequest(request_id=request_id))

    def detach(self, session_ids: tuple[str, ...]) -> None:
        """Detach sessions whose front end is gone (they expire after the grace period)."""
        self._send(DetachRequest(session_ids=session_ids))

    def _send(self, msg: EngineRequest) -> None:
        if self.inbox.dead is not None:
            raise self.inbox.dead
        try:
            self.link.send(msg)
        except RuntimeError as exc:  # the link is gone (the engine died, or restarts)
            self._link_failed(str(exc))
            raise self.inbox.dead or EngineDeadError("the engine is restarting") from None

    # ------------------------------------------------------------------ figures
    def stats(self) -> EngineStats:
        """The engine's figures, with this client's own pending calls."""
        return dataclasses.replace(self.figures.stats(), pending_calls=len(self.inbox.waiters))

    def drain_stage_latencies(self) -> list[tuple[str, float]]:
        return self.figures.drain_stage_latencies()

    def drain_stage_steps(self) -> list[tuple[str, int]]:
        return self.figures.drain_stage_steps()

    def drain_stage_waits(self) -> list[tuple[str, float]]:
        return self.figures.drain_stage_waits()

    def drain_stage_decodes(self) -> list[tuple[str, float, float]]:
        return self.figures.drain_stage_decodes()

    # ------------------------------------------------------------------ lifecycle
    async def shutdown(self) -> None:
        """End the link (in process: stop the orchestrator; a remote engine keeps running
        for its other front ends) and fail every waiter and stream; safe to call twice."""
        async with self._shutdown_lock:
            await self.link.close()
            self.inbox.die(EngineDeadError("engine shut down"))


def _guesses(spec: SpeculativeAsr | None) -> dict[str, int]:
    """Speculative transcripts of pauses by outcome (engine/orchestration/speculation.py)."""
    if spec is None:
        return {}
    return {
        "started": spec.started,
        "skipped": spec.skipped,
        "used": spec.used,
        "reguessed": spec.reguesses,
    }


class OrchestratorFigures:
    """The in-process engine's figures, read off its orchestrator when asked."""

    def __init__(self, link: InProcessLink) -> None:
        self.link = link
        self.orchestrator = link.orchestrator

    def stats(self) -> EngineStats:
        orch = self.orchestrator
        control = orch.control
        return EngineStats(
            sessions=control.counts(),
            admissions=dict(control.admissions),
            stale_chunks_dropped=orch.counters.stale_dropped,
            request_queue_depth=self.link.backlog(),
            output_queue_depth=self.link.output_backlog(),
            pending_calls=0,
            stage_restarts={
                name: sum(r.restarts for r in pool.replicas) for name, pool in orch.pools.items()
            },
            stages_down=orch.stages_down(),
            replicas_down=orch.replicas_down(),
            session_bytes=dict(orch.counters.session_bytes),
            speculative_responses=dict(orch.counters.drafts),
            speculative_transcripts=_guesses(orch.speculation),
            stage_engines=stage_engine_figures({n: p.replicas for n, p in orch.pools.items()}),
            scheduling=orch.scheduling_figures(),
        )

    def drain_stage_steps(self) -> list[tuple[str, int]]:
        return self.orchestrator.counters.drain_steps()

    def drain_stage_latencies(self) -> list[tuple[str, float]]:
        return self.orchestrator.counters.drain_latencies()

    def drain_stage_waits(self) -> list[tuple[str, float]]:
        return self.orchestrator.counters.drain_waits()

    def drain_stage_decodes(self) -> list[tuple[str, float, float]]:
        return self.orchestrator.counters.drain_decodes()


class AsyncEngine(EngineClient):
    """The engine in this process: its orchestrator thread, reached through janus queues.
    Create with ``await AsyncEngine.start(config)``; see docs/engine.md."""

    def __init__(self, config: EngineConfig, inbox: EngineInbox, link: InProcessLink) -> None:
        super().__init__(config, inbox, link, OrchestratorFigures(link))
        #: the engine's orchestrator (tests look inside it)
        self.orchestrator: Orchestrator = link.orchestrator

    @classmethod
    async def start(
        cls,
        config: EngineConfig,
        backends: Mapping[str, Sequence[StageBackend]] | None = None,
        *,
        tracer: Tracer | None = None,
    ) -> AsyncEngine:
        """Start the orchestrator and load the stages. ``tracer``: record a span per stage
        request in the callers' traces (engine/spans.py); None: no spans."""
        inbox = EngineInbox()
        link = await InProcessLink.start(config, backends, EngineTracing(tracer), inbox)
        return cls(config, inbox, link)
