"""The sessions' turns: one runner task per session with committed turns, running its jobs
in order (each turn's transcript, its words into the history, then its response), a failed
turn answered with a failed ``ResponseDone``, and a barge-in's cancel of the running turn."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from duplex_contract.errors import EngineError, StageError
from duplex_contract.session_events import ErrorInfo, ResponseDone, ResponseStarted, UserTranscript
from engine.duplex.control_plane import DuplexControl
from engine.duplex.effects import Cancel
from engine.duplex.fencing import epoch_prefix
from engine.duplex.session import DuplexSession, TurnJob
from engine.orchestration.draft_book import DraftBook
from engine.orchestration.output_router import Emit
from engine.orchestration.responder import Responder
from engine.orchestration.scheduling import Scheduler
from engine.orchestration.speculation import SpeculativeAsr
from engine.spans import EngineTracing
from engine.tasks import cancelling

log = logging.getLogger(__name__)


@dataclass
class Runner:
    """A session's runner task and the job it runs now."""

    task: asyncio.Task[None]
    job: TurnJob | None = None
    started: bool = False  # ResponseStarted was emitted for ``job``


class Runners:
    """Each session's runner (one loop). The scheduling policy asks it whether a real
    turn runs elsewhere; the turn runner adds and removes the runners."""

    def __init__(self) -> None:
        self._by_session: dict[str, Runner] = {}

    def get(self, sid: str) -> Runner | None:
        return self._by_session.get(sid)

    def add(self, sid: str, task: asyncio.Task[None]) -> None:
        self._by_session[sid] = Runner(task=task)

    def pop(self, sid: str) -> Runner | None:
        return self._by_session.pop(sid, None)

    def turn_running(self, besides: str) -> bool:
        """A real turn runs in a session other than ``besides``."""
        return any(r.job is not None for s, r in self._by_session.items() if s != besides)

    def tasks(self) -> list[asyncio.Task[None]]:
        return [r.task for r in self._by_session.values()]


class TurnRunner:
    """Runs each session's turns, in order, on the orchestrator's loop: the control plane
    hands out the jobs (``next_job``) and hears of each end (``job_done``)."""

    def __init__(
        self,
        runners: Runners,
        control: DuplexControl,
        responder: Responder,
        drafts: DraftBook,
        scheduler: Scheduler,
        speculation: SpeculativeAsr,
        tracing: EngineTracing,
        *,
        emit: Emit,
        abort: Callable[[str, str], None],
        track: Callable[[asyncio.Task[Any]], None],
        keep: Callable[[str], None] = lambda sid: None,
    ) -> None:
        self._runners = runners
        self._control = control
        self._responder = responder
        self._drafts = drafts
        self._scheduler = scheduler
        self._speculation = speculation
        self._tracing = tracing
        self._emit = emit
        self._abort = abort
        self._track = track
        self._keep = keep  # the session store keeps the conversation (a turn moved on)

    def ensure(self, sid: str) -> None:
        """The session has a job to run: start its runner unless one runs."""
        runner = self._runners.get(sid)
        if runner is not None and not runner.task.done():
            return
        task = asyncio.create_task(self._run_session(sid), name=f"runner:{sid}")
        self._runners.add(sid, task)

    async def stop(self, sid: str) -> None:
        """The session closes: cancel its runner and wait until it has unwound."""
        runner = self._runners.pop(sid)
        if runner is not None:
            runner.task.cancel()
            await asyncio.gather(runner.task, return_exceptions=True)

    def cancel(self, cancel: Cancel) -> None:
        """A barge-in, response.cancel or input.cancel: the session's draft goes, a turn of
        the old epoch is cancelled (its response ends ``cancelled`` if it had started),
        and the epoch's stage requests are aborted."""
        sid = cancel.session_id
        self._drafts.drop(sid)
        runner = self._runners.get(sid)
        prefix = epoch_prefix(sid, cancel.old_epoch)
        if (
            runner is not None
            and runner.job is not None
            and runner.job.fence.epoch == cancel.old_epoch
        ):
            job, started = runner.job, runner.started
            runner.task.cancel()
            self._track(runner.task)
            self._runners.pop(sid)
            if job.respond and started:
                session = self._control.sessions.get(sid)
                if session is not None:
                    session.history.finish_assistant(
                        job.fence.turn_id, job.fence.response_seq, "cancelled"
                    )
                self._emit(
                    sid,
                    ResponseDone(fence=job.fence, status="cancelled", reason=cancel.reason),
                    final=True,
                )
                self._keep(sid)
        self._abort(sid, prefix)

    async def _run_session(self, sid: str) -> None:
        runner = self._runners.get(sid)
        assert runner is not None
        control, scheduler = self._control, self._scheduler
        while (job := control.next_job(sid)) is not None:
            runner.job, runner.started = job, False
            session = control.sessions[sid]
            self._drafts.drop_others(sid)  # (as the scheduling policy says)
            if job.respond:  # batch work waits until this turn's first output is out
                scheduler.enter_critical(job.fence.key())
            try:
                with self._tracing.turn(job.traceparent):
                    await self._run_turn(session, job, runner)
            except asyncio.CancelledError:
                if cancelling():
                    raise  # this runner was cancelled (barge-in, close, shutdown)
                # something the turn awaited was cancelled, not the runner: fail the turn
                # and go on, never leave the session's job unfinished
                self._fail_turn(sid, job, runner, StageError("a stage request was cancelled"))
            except EngineError as exc:
                self._fail_turn(sid, job, runner, exc)
            except Exception as exc:
                log.exception("turn %s failed", job.fence.key())
                self._fail_turn(sid, job, runner, StageError(f"internal error: {exc!r}"))
            finally:
                scheduler.leave_critical(job.fence.key())
                if runner.job is job:
                    runner.job = None
                self._drafts.drop(sid)  # one the turn did not adopt
            control.job_done(sid, job, time.monotonic())
            self._keep(sid)

    def _fail_turn(self, sid: str, job: TurnJob, runner: Runner, exc: EngineError) -> None:
        if not job.respond:
            return
        if not runner.started:
            self._emit(sid, ResponseStarted(fence=job.fence))
            runner.started = True
        info = ErrorInfo.from_exc(exc, session_id=sid, request_id=job.fence.key())
        self._emit(sid, ResponseDone(fence=job.fence, status="failed", reason=exc.code, error=info))

    async def _run_turn(self, session: DuplexSession, job: TurnJob, runner: Runner) -> None:
        sid, fence = session.session_id, job.fence
        history = session.history
        text = job.text
        heard = ""
        t_job = time.perf_counter()
        marks: dict[str, float] = {}
        if job.audio:
            heard = await self._speculation.transcript(fence, job.audio, job.stream_ms)
            marks["asr_wait"] = (time.perf_counter() - t_job) * 1000
            self._emit(sid, UserTranscript(fence=fence, text=heard, final=True))
            text = f"{text} {heard}".strip()
        for item_id, part in job.items:
            if part.strip():
                history.add_user(part, fence.turn_id, item_id)
        for output in job.tool_outputs:
            history.add_tool_output(output, fence.turn_id)
        if heard and not job.audio_deleted:
            history.add_user(heard, fence.turn_id, job.audio_item)
        job.heard = True
        self._keep(sid)
        if not job.respond:
            return
        runner.started = True
        self._emit(sid, ResponseStarted(fence=fence))
        if job.audio and not text:
            self._emit(sid, ResponseDone(fence=fence, status="incomplete", reason="no_speech"))
            return
        await self._responder.respond(session, job, marks)
