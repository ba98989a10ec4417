"""The supervisor of an out-of-process engine (engine/stages/supervisor.py), with fakes: a
dead engine fails what is in flight, reports itself down, and is restarted a bounded number
of times. The vLLM tier kills a real EngineCore (tests/vllm/test_vllm_restart.py)."""

from __future__ import annotations

import asyncio

from engine.stages.supervisor import Supervisor
from tests.engine.conftest import UNIT, run


class FakeEngine:
    def __init__(self, restarts_fail: int = 0) -> None:
        self.dead: str | None = None
        self.failed: list[str] = []
        self.restarts_fail = restarts_fail
        self.started = 0

    def probe(self) -> str | None:
        return self.dead

    def fail(self, reason: str) -> None:
        self.failed.append(reason)

    async def restart(self) -> None:
        self.started += 1
        if self.restarts_fail > 0:
            self.restarts_fail -= 1
            raise RuntimeError("no GPU memory left")
        self.dead = None


def supervise(engine: FakeEngine, max_restarts: int = 3) -> Supervisor:
    return Supervisor(
        "llm0",
        probe=engine.probe,
        fail_requests=engine.fail,
        restart=engine.restart,
        max_restarts=max_restarts,
        interval_s=0.01,
        backoff_s=0.01,
    )


async def until(check: object, within: float = 5 * UNIT) -> None:
    deadline = asyncio.get_running_loop().time() + within
    while not check():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


def test_a_dead_engine_is_reported_failed_and_restarted() -> None:
    async def go() -> None:
        engine = FakeEngine()
        sup = supervise(engine)
        task = asyncio.create_task(sup.run())
        try:
            await asyncio.sleep(0.05)
            assert sup.health() is None and sup.restarts == 0
            engine.dead = "vLLM EngineCore died (its process was killed by signal 9)"
            await until(lambda: sup.health() is not None)
            assert sup.health() == (
                "llm0: vLLM EngineCore died (its process was killed by signal 9); "
                "restarting (attempt 1 of 3)"
            )
            assert engine.failed == [sup.health()]  # in-flight requests failed with it
            await until(lambda: sup.health() is None)
            assert sup.restarts == 1 and engine.started == 1
            engine.dead = "died again"  # a second death is restarted as well
            await until(lambda: sup.restarts == 2 and sup.health() is None)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    run(go())


def test_failed_restarts_are_retried_then_given_up() -> None:
    async def go() -> None:
        engine = FakeEngine(restarts_fail=10)
        sup = supervise(engine, max_restarts=2)
        engine.dead = "gone"
        await asyncio.wait_for(sup.run(), 5 * UNIT)  # returns once the budget is spent
        assert sup.restarts == 2 and engine.started == 2 and sup.gave_up
        down = sup.health()
        assert down is not None and down.startswith(
            "llm0: restart attempt 2 failed: RuntimeError: no GPU memory left; not restarted"
        )
        assert down.endswith("(max_restarts=2 attempts made)")
        assert engine.failed[-1] == down

    run(go())


def test_max_restarts_zero_never_restarts() -> None:
    async def go() -> None:
        engine = FakeEngine()
        sup = supervise(engine, max_restarts=0)
        engine.dead = "gone"
        await asyncio.wait_for(sup.run(), 5 * UNIT)
        assert engine.started == 0 and sup.restarts == 0
        assert sup.health() == "llm0: gone; not restarted again (max_restarts=0 attempts made)"

    run(go())


def test_a_request_that_saw_the_engine_die_reports_it_down_at_once() -> None:
    async def go() -> None:
        engine = FakeEngine()
        sup = supervise(engine)
        sup.suspect("vLLM EngineCore died")  # before any probe ran
        assert sup.health() == "llm0: vLLM EngineCore died; restarting"
        task = asyncio.create_task(sup.run())
        try:  # the probe does not confirm it (the engine is alive): cleared
            await until(lambda: sup.health() is None)
            assert sup.restarts == 0
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    run(go())
