"""SessionCleanup (engine/orchestration/session_cleanup.py): a closing session's work is
stopped in order, and its slot is freed (``finish``) only once every stage abort has
finished; a clean-up that times out or fails is left for the reaper to retry."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from engine.orchestration.background import BackgroundTasks
from engine.orchestration.session_cleanup import SessionCleanup
from engine.orchestration.stage_aborts import StageAborts
from tests.engine.conftest import run
from tests.engine.parts_fakes import Calls, Pool, Tracing, settle

SID = "sess_a"


class Turns:
    def __init__(self, log: list[tuple[Any, ...]]) -> None:
        self.log = log

    async def stop(self, sid: str) -> None:
        self.log.append(("stop", sid))


class Setup:
    def __init__(self, pool: Pool, timeout_s: float = 1.0, fail: bool = False) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.pool = pool
        self.tasks = BackgroundTasks()
        self.aborts = StageAborts({"llm": pool}, self.tasks.spawn)
        self.tracing = Tracing()
        speculation = Calls(self.log)
        if fail:
            speculation = Calls(self.log, drop=None)
            speculation.drop = self._boom  # type: ignore[method-assign]
        self.cleanup = SessionCleanup(
            timeout_s,
            Calls(self.log),  # type: ignore[arg-type]  # the draft book
            self.aborts,
            Turns(self.log),  # type: ignore[arg-type]
            speculation,  # type: ignore[arg-type]
            {"llm": pool},
            self.tracing,  # type: ignore[arg-type]
            Calls(self.log),  # type: ignore[arg-type]  # live partials
            finish=lambda sid: self.log.append(("finish", sid)),
            spawn=self.tasks.spawn,
        )

    @staticmethod
    def _boom(sid: str) -> None:
        raise RuntimeError("injected")

    async def finished(self) -> None:
        await asyncio.gather(*self.tasks.tasks(), return_exceptions=True)
        await settle()


def test_a_session_is_finished_once_its_work_has_stopped() -> None:
    async def main() -> None:
        s = Setup(Pool(f"{SID}/e0/t1r1/llm", "sess_b/e0/t1r1/llm"))
        s.cleanup.start(SID)
        assert s.cleanup.cleaning == {SID}
        await s.finished()
        assert s.log == [
            ("drop", SID),  # its draft
            ("stop", SID),  # its runner
            ("drop", SID),  # its speculative transcripts
            ("drop", SID),  # its live partials
            ("finish", SID),
        ]
        # the clean-up waits for the abort itself too (aborting twice is harmless)
        assert set(s.pool.aborted) == {f"{SID}/e0/t1r1/llm"} and s.pool.released == [SID]
        assert s.tracing.closed == [SID] and s.aborts.pending(SID) == []
        assert s.cleanup.cleaning == set()

    run(main())


def test_a_session_is_cleaned_up_once_at_a_time() -> None:
    async def main() -> None:
        s = Setup(Pool())
        s.cleanup.start(SID)
        s.cleanup.start(SID)
        assert [t.get_name() for t in s.tasks.tasks()] == [f"cleanup:{SID}"]
        await s.finished()
        assert s.log.count(("finish", SID)) == 1

    run(main())


def test_aborts_that_do_not_finish_leave_the_slot_taken(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        pool = Pool(f"{SID}/e0/t1r1/llm")
        pool.gate.clear()  # the stage never answers the abort
        s = Setup(pool, timeout_s=0.05)
        with caplog.at_level(logging.WARNING, "engine.orchestration.session_cleanup"):
            s.cleanup.start(SID)
            for _ in range(100):
                if not s.cleanup.cleaning:
                    break
                await asyncio.sleep(0.01)
        assert ("finish", SID) not in s.log and s.pool.released == []
        assert len(s.aborts.pending(SID)) == 1  # a retry waits for it again
        assert s.cleanup.cleaning == set()  # so the reaper hands it out again
        pool.gate.set()
        await s.finished()

    run(main())
    assert any("the reaper retries" in r.getMessage() for r in caplog.records)


def test_a_failed_cleanup_is_logged_and_left_for_a_retry(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        s = Setup(Pool(), fail=True)
        with caplog.at_level(logging.ERROR, "engine.orchestration.session_cleanup"):
            s.cleanup.start(SID)
            await s.finished()
        assert ("finish", SID) not in s.log and s.cleanup.cleaning == set()

    run(main())
    assert any("cleanup of sess_a failed" in r.getMessage() for r in caplog.records)
