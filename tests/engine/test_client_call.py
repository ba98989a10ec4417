"""A control call's wait: a cancellation that arrives together with the result is never
lost (Python 3.11's ``asyncio.wait_for`` lost it, and a session's caller then never ended);
a call that gets no answer times out; an opened session's mailbox is kept."""

from __future__ import annotations

import asyncio

import pytest

from duplex_contract.control import ControlResult, OpenCall
from duplex_contract.errors import ControlError, EngineDeadError
from duplex_contract.fence import Fence
from engine.api.client import EngineClient, EngineStats
from engine.api.inbox import EngineInbox
from engine.messages import ControlRequest, EngineRequest
from tests.engine.conftest import make_config


class HeldLink:
    """A link whose requests go nowhere: the test answers them by hand."""

    def __init__(self) -> None:
        self.sent: list[EngineRequest] = []
        self.open = True

    def send(self, msg: EngineRequest) -> None:
        self.sent.append(msg)

    def backlog(self) -> int:
        return len(self.sent)

    async def close(self) -> None:
        self.open = False


class NoFigures:
    def stats(self) -> EngineStats:
        return EngineStats({}, {}, 0, 0, 0, 0, {})

    def drain_stage_latencies(self) -> list[tuple[str, float]]:
        return []

    def drain_stage_steps(self) -> list[tuple[str, int]]:
        return []

    def drain_stage_waits(self) -> list[tuple[str, float]]:
        return []

    def drain_stage_decodes(self) -> list[tuple[str, float, float]]:
        return []


def _client() -> tuple[EngineClient, HeldLink]:
    link = HeldLink()
    return EngineClient(make_config(), EngineInbox(), link, NoFigures()), link


def _answer(engine: EngineClient, link: HeldLink, **result: object) -> None:
    (req,) = link.sent
    assert isinstance(req, ControlRequest)
    engine.inbox.receive(ControlResult(control_id=req.control_id, **result))  # type: ignore[arg-type]


def test_a_cancel_that_arrives_with_the_result_is_not_lost() -> None:
    async def main() -> None:
        engine, link = _client()
        task = asyncio.create_task(engine.call(OpenCall()))
        await asyncio.sleep(0)  # the call waits for its answer
        _answer(engine, link, ok=True)
        task.cancel()  # in the same step as the answer
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


def test_a_call_times_out_as_deadline_exceeded() -> None:
    async def main() -> None:
        engine, _ = _client()
        with pytest.raises(ControlError) as info:
            await engine.call(OpenCall(), wait_s=0.01)
        assert info.value.code == "deadline_exceeded"
        assert len(engine.inbox.waiters) == 0 and engine.stats().pending_calls == 0

    asyncio.run(main())


def test_an_opened_session_has_its_mailbox_and_death_ends_its_stream() -> None:
    async def main() -> None:
        engine, link = _client()
        task = asyncio.create_task(engine.call(OpenCall()))
        await asyncio.sleep(0)
        assert engine.stats().pending_calls == 1
        _answer(engine, link, ok=True, session_id="sess_x", accepted_fence=Fence("sess_x"))
        assert (await task).session_id == "sess_x"
        assert "sess_x" in engine.inbox.mailboxes._sessions  # its events wait there
        engine.inbox.die(EngineDeadError("gone"))
        assert not engine.ready
        with pytest.raises(EngineDeadError, match="gone"):
            async for _ in engine.session_events("sess_x"):
                pass
        with pytest.raises(EngineDeadError, match="gone"):  # and every later call
            await engine.call(OpenCall())

    asyncio.run(main())
