"""TurnRunner and Runners (engine/orchestration/turn_runner.py) with fakes beside them: one
runner per session runs its jobs in order, a turn's words go into the history before its
response, a failed turn ends ``failed`` and the next one runs, and a barge-in cancels the
running turn of the old epoch (its response ends ``cancelled``, routed as final)."""

from __future__ import annotations

import asyncio
from collections import defaultdict, deque
from typing import Any

import pytest

from duplex_contract.errors import StageError
from duplex_contract.fence import Fence
from duplex_contract.session_events import ResponseDone, ResponseStarted, UserTranscript
from engine.duplex.effects import Cancel
from engine.duplex.fencing import epoch_prefix
from engine.duplex.session import DuplexSession, TurnJob
from engine.orchestration.turn_runner import Runners, TurnRunner
from tests.engine.conftest import run
from tests.engine.parts_fakes import Calls, Emitted, Tracing, job, session, settle

SID = "sess_a"


class Control:
    def __init__(self, *sessions: DuplexSession) -> None:
        self.sessions = {s.session_id: s for s in sessions}
        self.jobs: dict[str, deque[TurnJob]] = defaultdict(deque)
        self.done: list[TurnJob] = []

    def next_job(self, sid: str) -> TurnJob | None:
        queue = self.jobs[sid]
        return queue.popleft() if queue else None

    def job_done(self, sid: str, job: TurnJob, now: float) -> None:
        self.done.append(job)


class Responder:
    def __init__(self) -> None:
        self.calls: list[tuple[TurnJob, dict[str, float]]] = []
        self.gate: asyncio.Event | None = None
        self.error: BaseException | None = None

    async def respond(
        self, session: DuplexSession, job: TurnJob, marks: dict[str, float] | None = None
    ) -> None:
        self.calls.append((job, dict(marks or {})))
        session.history.start_assistant(job.fence.turn_id, job.fence.response_seq)
        if self.error is not None:
            raise self.error
        if self.gate is not None:
            await self.gate.wait()


class Speculation:
    def __init__(self, heard: str) -> None:
        self.heard = heard

    async def transcript(self, fence: Fence, audio: bytes, stream_ms: float | None) -> str:
        return self.heard


class Setup:
    def __init__(self, heard: str = "") -> None:
        self.session = session(SID)
        self.control = Control(self.session)
        self.responder = Responder()
        self.log: list[tuple[Any, ...]] = []
        self.emitted = Emitted()
        self.aborted: list[tuple[str, str]] = []
        self.tracked: list[asyncio.Task[Any]] = []
        self.runners = Runners()
        self.turns = TurnRunner(
            self.runners,
            self.control,  # type: ignore[arg-type]
            self.responder,  # type: ignore[arg-type]
            Calls(self.log),  # type: ignore[arg-type]  # the draft book
            Calls(self.log),  # type: ignore[arg-type]  # the scheduling policy
            Speculation(heard),  # type: ignore[arg-type]
            Tracing(),  # type: ignore[arg-type]
            emit=self.emitted,
            abort=lambda sid, prefix: self.aborted.append((sid, prefix)),
            track=self.tracked.append,
        )

    def commit(self, job: TurnJob) -> None:
        self.control.jobs[SID].append(job)
        self.turns.ensure(SID)


def test_runners_say_where_a_real_turn_runs() -> None:
    async def main() -> None:
        runners = Runners()
        a = asyncio.create_task(asyncio.sleep(0))
        b = asyncio.create_task(asyncio.sleep(0))
        runners.add("sess_a", a)
        runners.add("sess_b", b)
        assert not runners.turn_running(besides="")  # runners, but no job yet
        runner = runners.get("sess_a")
        assert runner is not None and runner.task is a
        runner.job = job(Fence("sess_a", 0, 1, 1), "hi")
        assert runners.turn_running(besides="") and runners.turn_running(besides="sess_b")
        assert not runners.turn_running(besides="sess_a")
        assert runners.tasks() == [a, b]
        assert runners.pop("sess_a") is runner and runners.pop("sess_a") is None
        await asyncio.gather(a, b)

    run(main())


def test_a_text_turn_goes_into_the_history_then_is_answered() -> None:
    async def main() -> None:
        s = Setup()
        first = job(Fence(SID, 0, 1, 1), "hello there")
        s.commit(first)
        await settle()
        assert s.emitted.events() == [ResponseStarted(fence=first.fence)]
        assert [j for j, _ in s.responder.calls] == [first] and first.heard
        assert [m.content for m in s.session.history.messages("sys")][1:] == ["hello there"]
        key = first.fence.key()
        assert s.log == [
            ("drop_others", SID),
            ("enter_critical", key),
            ("leave_critical", key),
            ("drop", SID),
        ]
        assert s.control.done == [first]
        runner = s.runners.get(SID)
        assert runner is not None and runner.job is None and runner.task.done()

    run(main())


def test_a_turn_without_a_response_only_goes_into_the_history() -> None:
    async def main() -> None:
        s = Setup()
        quiet = job(Fence(SID, 0, 1, 0), "note this", respond=False)
        s.commit(quiet)
        await settle()
        assert s.emitted.out == [] and s.responder.calls == [] and quiet.heard
        assert [m.content for m in s.session.history.messages("sys")][1:] == ["note this"]
        assert ("enter_critical", quiet.fence.key()) not in s.log
        assert s.control.done == [quiet]

    run(main())


def test_an_audio_turn_is_transcribed_first() -> None:
    async def main() -> None:
        s = Setup(heard="what time is it")
        turn = job(Fence(SID, 0, 1, 1), audio=b"\1\0" * 800)
        s.commit(turn)
        await settle()
        assert s.emitted.events() == [
            UserTranscript(fence=turn.fence, text="what time is it", final=True),
            ResponseStarted(fence=turn.fence),
        ]
        ((_, marks),) = s.responder.calls
        assert set(marks) == {"asr_wait"}

    run(main())


def test_audio_without_words_ends_with_no_speech() -> None:
    async def main() -> None:
        s = Setup(heard="")
        turn = job(Fence(SID, 0, 1, 1), audio=b"\0\0" * 800)
        s.commit(turn)
        await settle()
        assert s.emitted.events()[1:] == [
            ResponseStarted(fence=turn.fence),
            ResponseDone(fence=turn.fence, status="incomplete", reason="no_speech"),
        ]
        assert s.responder.calls == [] and s.control.done == [turn]

    run(main())


def test_a_failed_turn_ends_failed_and_the_next_runs() -> None:
    async def main() -> None:
        s = Setup()
        s.responder.error = StageError("the llm is down")
        first, second = job(Fence(SID, 0, 1, 1), "one"), job(Fence(SID, 0, 2, 2), "two")
        s.commit(first)
        s.commit(second)
        await settle(10)
        kinds = [(type(e).__name__, e.fence.turn_id) for e in s.emitted.events()]  # type: ignore[union-attr]
        assert kinds == [
            ("ResponseStarted", 1),
            ("ResponseDone", 1),
            ("ResponseStarted", 2),
            ("ResponseDone", 2),
        ]
        done = s.emitted.events()[1]
        assert isinstance(done, ResponseDone) and done.status == "failed"
        assert done.reason == "stage_failed" and done.error is not None
        assert s.control.done == [first, second]

    run(main())


def test_a_barge_in_cancels_the_running_turn() -> None:
    async def main() -> None:
        s = Setup()
        s.responder.gate = asyncio.Event()  # the response goes on until cancelled
        turn = job(Fence(SID, 0, 1, 1), "tell me a story")
        s.commit(turn)
        await settle()
        runner = s.runners.get(SID)
        assert runner is not None and runner.started
        s.log.clear()
        s.turns.cancel(Cancel(SID, old_epoch=0, active=turn, reason="barge_in"))
        done = ResponseDone(fence=turn.fence, status="cancelled", reason="barge_in")
        assert s.emitted.out[-1] == (SID, done, True)  # final: its fence is stale now
        with pytest.raises(ValueError):  # the assistant turn was finished (cancelled)
            s.session.history.append_assistant_text(1, 1, "more")
        assert s.log == [("drop", SID)] and s.aborted == [(SID, epoch_prefix(SID, 0))]
        assert s.runners.get(SID) is None and s.tracked == [runner.task]
        await settle()
        assert runner.task.cancelled() and s.control.done == []

    run(main())


def test_a_cancel_of_another_epoch_leaves_the_turn_running() -> None:
    async def main() -> None:
        s = Setup()
        s.responder.gate = asyncio.Event()
        turn = job(Fence(SID, 1, 1, 1), "hi")
        s.commit(turn)
        await settle()
        n = len(s.emitted.out)
        s.turns.cancel(Cancel(SID, old_epoch=0, active=None, reason="input_cancelled"))
        assert len(s.emitted.out) == n and s.aborted == [(SID, epoch_prefix(SID, 0))]
        runner = s.runners.get(SID)
        assert runner is not None and not runner.task.done()
        s.responder.gate.set()
        await settle()
        assert s.control.done == [turn]

    run(main())


def test_stop_cancels_the_runner_and_waits_for_it() -> None:
    async def main() -> None:
        s = Setup()
        s.responder.gate = asyncio.Event()
        s.commit(job(Fence(SID, 0, 1, 1), "hi"))
        await settle()
        runner = s.runners.get(SID)
        assert runner is not None
        await s.turns.stop(SID)
        assert runner.task.cancelled() and s.runners.get(SID) is None
        await s.turns.stop(SID)  # nothing left: a no-op

    run(main())
