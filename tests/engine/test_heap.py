"""engine/heap.py: freed heap memory goes back to the OS, and the reaper does it on its own."""

from __future__ import annotations

import asyncio

import pytest

from engine import heap
from tests.engine.conftest import run, stages, start_engine

needs_glibc = pytest.mark.skipif(not heap.can_trim(), reason="malloc_trim is glibc's")


def _rss_mb() -> float:
    with open("/proc/self/status", encoding="ascii") as f:
        line = next(x for x in f if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


@needs_glibc
def test_trim_gives_freed_heap_pages_back() -> None:
    """200 MB of 4 KB blocks, freed below a block that stays: glibc keeps the pages (the
    heap's top is in use) until a trim releases them."""
    blocks = [bytes(4096) for _ in range(50_000)]  # > 512 bytes: malloc, not pymalloc
    keep = bytes(4096)
    held = _rss_mb()
    del blocks
    before = _rss_mb()
    assert heap.trim_heap() is True
    after = _rss_mb()
    assert held - before < 50  # free() alone returned little of it
    assert before - after > 150  # the trim returned most of the 200 MB
    del keep


def test_the_reaper_trims_the_heap_on_its_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(heap, "can_trim", lambda: True)
    monkeypatch.setattr(heap, "trim_heap", lambda: calls.append(1) or True)

    async def main(interval: float) -> int:
        engine = await start_engine(stages(), reaper_interval_s=0.02, heap_trim_interval_s=interval)
        try:
            await asyncio.sleep(0.5)
            orch = engine.orchestrator
            assert orch is not None
            return orch.counters.heap_trims
        finally:
            await engine.shutdown()

    trims = run(main(0.1))
    assert 1 <= trims <= 8 and len(calls) == trims  # about every 0.1 s, not every 0.02 s tick
    calls.clear()
    assert run(main(0.0)) == 0 and calls == []  # 0: never
