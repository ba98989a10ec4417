"""StageAborts (engine/orchestration/stage_aborts.py): a fence's stage requests are located
at once and aborted in a task; the plan stays with its session until the abort is done."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from engine.orchestration.background import BackgroundTasks
from engine.orchestration.stage_aborts import StageAborts
from tests.engine.conftest import run
from tests.engine.parts_fakes import Pool, settle


def test_a_fence_with_nothing_running_starts_no_abort() -> None:
    async def main() -> None:
        spawned: list[str] = []

        def spawn(coro: Coroutine[Any, Any, Any], name: str) -> None:
            coro.close()
            spawned.append(name)

        aborts = StageAborts({"llm": Pool("sess_b/e0/t1r1/llm")}, spawn)
        aborts.abort("sess_a", "sess_a/e0/")
        assert spawned == [] and aborts.pending("sess_a") == []

    run(main())


def test_the_plan_is_pending_until_its_abort_is_done() -> None:
    async def main() -> None:
        llm, tts = Pool("sess_a/e0/t1r1/llm", "sess_b/e0/t1r1/llm"), Pool("sess_a/e0/t1r1/tts")
        llm.gate.clear()
        tasks = BackgroundTasks()
        aborts = StageAborts({"llm": llm, "tts": tts}, tasks.spawn)
        aborts.abort("sess_a", "sess_a/e0/")
        assert [t.get_name() for t in tasks.tasks()] == ["abort:sess_a/e0/"]
        (plan,) = aborts.pending("sess_a")
        assert [located for _, located in plan] == [
            [(0, ["sess_a/e0/t1r1/llm"])],
            [(0, ["sess_a/e0/t1r1/tts"])],
        ]
        await settle()
        assert tts.aborted == ["sess_a/e0/t1r1/tts"] and llm.aborted == []
        assert len(aborts.pending("sess_a")) == 1  # the llm's abort still runs
        llm.gate.set()
        await settle()
        assert llm.aborted == ["sess_a/e0/t1r1/llm"] and llm.running == ["sess_b/e0/t1r1/llm"]
        assert aborts.pending("sess_a") == [] and tasks.tasks() == []

    run(main())


def test_a_cleaned_up_session_forgets_its_plans() -> None:
    async def main() -> None:
        pool = Pool("sess_a/e0/t1r1/llm")
        pool.gate.clear()
        tasks = BackgroundTasks()
        aborts = StageAborts({"llm": pool}, tasks.spawn)
        aborts.abort("sess_a", "sess_a/")
        plans = aborts.pending("sess_a")
        pool.gate.set()
        await asyncio.gather(*(StageAborts.run(p) for p in plans))  # as a clean-up waits
        aborts.forget("sess_a")
        assert aborts.pending("sess_a") == []
        await asyncio.gather(*tasks.tasks())

    run(main())


def test_abort_now_waits_for_the_abort() -> None:
    async def main() -> None:
        pool = Pool("batch/r1/llm", "batch/r2/llm")
        aborts = StageAborts({"llm": pool}, lambda coro, name: coro.close())
        await aborts.abort_now("batch/r1/")
        assert pool.aborted == ["batch/r1/llm"] and aborts.pending("batch") == []

    run(main())


def test_pools_added_later_are_aborted_too() -> None:
    async def main() -> None:
        pools: dict[str, Pool] = {}
        aborts = StageAborts(pools, lambda coro, name: coro.close())
        pools["asr"] = Pool("sess_a/e0/t1r1/asr")  # the stages start after the parts exist
        await aborts.abort_now("sess_a/")
        assert pools["asr"].aborted == ["sess_a/e0/t1r1/asr"]

    run(main())
