"""Retry-safe control calls: a call with an ``operation_id`` that gets no answer in time is
sent once more with the same id (a late first answer is dropped), then fails with
``deadline_exceeded``; the engine answers a repeat with its first answer, so a commit sent
twice commits once (one turn, one response)."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from duplex_contract.control import AppendCall, CommitCall, ControlResult, OpenCall
from duplex_contract.errors import ControlError
from duplex_contract.fence import Fence
from duplex_contract.session_events import ResponseDone, ResponseStarted
from duplex_contract.settings import SessionSettings
from engine.api.client import EngineClient
from engine.api.inbox import EngineInbox
from engine.messages import ControlRequest
from tests.engine.conftest import collect, make_config, run, start_engine
from tests.engine.test_client_call import HeldLink, NoFigures

SID = "sess_0123456789abcdef0123456789abcdef"


def _client(timeout_s: float) -> tuple[EngineClient, HeldLink]:
    link = HeldLink()
    config = msgspec.structs.replace(make_config(), control_timeout_s=timeout_s)
    return EngineClient(config, EngineInbox(), link, NoFigures()), link


def test_a_call_unanswered_in_time_is_sent_once_more_with_its_operation_id() -> None:
    async def main() -> None:
        engine, link = _client(0.1)
        call = CommitCall(fence=Fence(SID), lease_generation=1, operation_id="op-7")
        task = asyncio.create_task(engine.call(call))
        for _ in range(500):  # past the first deadline: sent again
            if len(link.sent) == 2:
                break
            await asyncio.sleep(0.01)
        first, second = link.sent
        assert isinstance(first, ControlRequest) and isinstance(second, ControlRequest)
        assert first.call == second.call == call and first.control_id != second.control_id
        engine.inbox.receive(ControlResult(control_id=second.control_id, ok=True, session_id=SID))
        assert (await task).ok
        engine.inbox.receive(ControlResult(control_id=first.control_id, ok=True))  # too late
        assert engine.inbox.waiters.late_replies == 1
        # twice unanswered: deadline_exceeded, and no third send
        task = asyncio.create_task(engine.call(call))
        with pytest.raises(ControlError) as err:
            await task
        assert err.value.code == "deadline_exceeded" and len(link.sent) == 4

    run(main())


def test_a_commit_sent_twice_with_one_operation_id_commits_once() -> None:
    async def main() -> None:
        engine = await start_engine()
        try:
            opened = await engine.call(
                OpenCall(config=SessionSettings(output_modalities=("text",)))
            )
            sid, fence = opened.session_id, opened.accepted_fence
            assert sid and fence
            await engine.call(AppendCall(fence=fence, lease_generation=1, text="hi"))
            commit = CommitCall(fence=fence, lease_generation=1, operation_id="commit-1")
            # the retry arrives before the first answer was read: both are answered
            first, again = await asyncio.gather(engine.call(commit), engine.call(commit))
            assert not first.deduplicated and again.deduplicated
            assert first.accepted_fence == again.accepted_fence
            events = await collect(engine, sid, lambda e: isinstance(e, ResponseDone))
            assert sum(isinstance(e, ResponseStarted) for e in events) == 1
            await asyncio.sleep(0.3)  # no second turn follows
            session = engine.orchestrator.control.sessions[sid]
            assert session.fence.turn_id == 1 and not session.jobs and session.active is None
            assert len(session.history) == 2  # one user turn, one answer
        finally:
            await engine.shutdown()

    run(main())
