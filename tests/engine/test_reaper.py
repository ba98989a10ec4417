"""Reaper (engine/orchestration/reaper.py): each tick carries out what the control plane's
``tick`` returns and measures what the engine holds for its sessions; a failed tick is
logged and the next one comes."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from engine.config import DuplexRuntimeConfig
from engine.duplex.effects import Effects
from engine.duplex.session import DuplexSession
from engine.orchestration.counters import Counters
from engine.orchestration.reaper import Reaper
from tests.engine.conftest import run
from tests.engine.parts_fakes import session


class Control:
    def __init__(self, *sessions: DuplexSession) -> None:
        self.sessions = {s.session_id: s for s in sessions}
        self.ticks: list[set[str]] = []
        self.fail = False

    def tick(self, now: float, cleaning: set[str]) -> Effects:
        self.ticks.append(set(cleaning))
        if self.fail:
            raise RuntimeError("injected")
        return Effects(cleanups=["sess_b"])


class Held:
    nbytes = 300  # the speculative transcripts'
    held_bytes = 40  # the drafts'


def _reaper(control: Control, applied: list[Effects], **cfg: Any) -> tuple[Reaper, Counters]:
    counters = Counters()
    config = DuplexRuntimeConfig(reaper_interval_s=0.01, heap_trim_interval_s=0.0, **cfg)
    reaper = Reaper(
        config,
        control,  # type: ignore[arg-type]
        counters,
        Held(),  # type: ignore[arg-type]
        Held(),  # type: ignore[arg-type]
        cleaning={"sess_c"},
        apply=applied.append,
    )
    return reaper, counters


def test_session_bytes_by_part() -> None:
    a, b = session("sess_a"), session("sess_b")
    a.audio += b"\0" * 1000
    a.text_parts.append("hello")
    b.history.add_user("x" * 20, 1)
    reaper, _ = _reaper(Control(a, b), [])
    got = reaper.session_bytes()
    assert got["engine_input"] == 1005 and got["history"] == a.history.nbytes + b.history.nbytes
    assert (got["speculation"], got["draft"]) == (300, 40)


def test_each_tick_applies_the_control_planes_effects() -> None:
    async def main() -> tuple[Control, list[Effects], Counters]:
        control, applied = Control(session("sess_a")), []
        reaper, counters = _reaper(control, applied)
        task = asyncio.create_task(reaper.run())
        await asyncio.sleep(0.1)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return control, applied, counters

    control, applied, counters = run(main())
    assert len(applied) >= 2 and applied[0] == Effects(cleanups=["sess_b"])
    assert control.ticks[0] == {"sess_c"}  # a session whose clean-up runs is not handed out
    assert counters.session_bytes["speculation"] == 300 and counters.heap_trims == 0


def test_a_failed_tick_is_logged_and_the_next_comes(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> Control:
        control = Control()
        control.fail = True
        reaper, _ = _reaper(control, [])
        with caplog.at_level(logging.ERROR, "engine.orchestration.reaper"):
            task = asyncio.create_task(reaper.run())
            await asyncio.sleep(0.1)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return control

    assert len(run(main()).ticks) >= 2
    assert any("reaper tick failed" in r.getMessage() for r in caplog.records)
