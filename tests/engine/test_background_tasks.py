"""BackgroundTasks (engine/orchestration/background.py): unawaited tasks are kept until they
end, their outcome is read (no "exception was never retrieved"), shutdown gets the rest."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

from engine.orchestration.background import BackgroundTasks
from tests.engine.conftest import run
from tests.engine.parts_fakes import settle


def test_tasks_are_kept_until_they_end() -> None:
    async def main() -> None:
        tasks = BackgroundTasks()
        gate = asyncio.Event()

        async def work() -> None:
            await gate.wait()

        tasks.spawn(work(), "work:1")
        (task,) = tasks.tasks()
        assert task.get_name() == "work:1"
        gate.set()
        await settle()
        assert task.done() and tasks.tasks() == []

    run(main())


def test_a_failed_or_cancelled_task_is_reaped() -> None:
    async def main() -> None:
        unretrieved: list[dict[str, Any]] = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: unretrieved.append(ctx))
        tasks = BackgroundTasks()

        async def fail() -> None:
            raise RuntimeError("boom")

        async def hang() -> None:
            await asyncio.Event().wait()

        tasks.spawn(fail(), "fail")
        hung = asyncio.create_task(hang())
        tasks.track(hung)  # a task made elsewhere (a cancelled runner unwinding)
        await settle()
        hung.cancel()
        await settle()
        assert tasks.tasks() == []
        del hung
        gc.collect()
        assert unretrieved == []

    run(main())


def test_shutdown_cancels_what_is_left() -> None:
    async def main() -> None:
        tasks = BackgroundTasks()
        tasks.spawn(asyncio.Event().wait(), "hang")
        left = tasks.tasks()
        for t in left:
            t.cancel()
        await asyncio.gather(*left, return_exceptions=True)
        assert all(t.cancelled() for t in left) and tasks.tasks() == []

    run(main())
