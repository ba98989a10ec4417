"""A control call's wait: a cancellation that arrives together with the result is never
lost (Python 3.11's ``asyncio.wait_for`` lost it, and a session's caller then never ended)."""

from __future__ import annotations

import asyncio

import pytest

from duplex_contract.control import ControlCall, ControlResult, OpenCall
from engine.api.client import AsyncEngine
from tests.engine.conftest import make_config


class _Unstarted(AsyncEngine):
    """Calls go nowhere; the test answers them by hand."""

    def submit_call(self, call: ControlCall) -> tuple[int, asyncio.Future[ControlResult]]:
        fut: asyncio.Future[ControlResult] = asyncio.get_running_loop().create_future()
        self.answer = fut
        return 1, fut


def test_a_cancel_that_arrives_with_the_result_is_not_lost() -> None:
    async def main() -> None:
        engine = _Unstarted(make_config())
        task = asyncio.create_task(engine.call(OpenCall()))
        await asyncio.sleep(0)  # the call waits for its answer
        engine.answer.set_result(ControlResult(control_id=1, ok=True))
        task.cancel()  # in the same step as the answer
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


def test_a_call_times_out_as_deadline_exceeded() -> None:
    async def main() -> None:
        engine = _Unstarted(make_config())
        with pytest.raises(Exception) as info:
            await engine.call(OpenCall(), wait_s=0.01)
        assert getattr(info.value, "code", None) == "deadline_exceeded"

    asyncio.run(main())
