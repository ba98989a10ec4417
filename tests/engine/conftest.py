"""Engine fixtures: an AsyncEngine on the deterministic test stage."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

import msgspec
import pytest

from engine.client import AsyncEngine
from engine.config import EngineConfig, load_engine_config
from engine.messages import SessionEvent
from engine.stages.base import StageBackend
from engine.stages.testing import TestStage, TestStageOptions

ROOT = Path(__file__).resolve().parents[2]
UNIT = 1.0  # seconds; every timeout in engine tests is a multiple of this


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(coro)


def make_config(**duplex: Any) -> EngineConfig:
    cfg = load_engine_config(ROOT / "configs" / "test.yaml")
    if duplex:
        cfg = msgspec.structs.replace(cfg, duplex=msgspec.structs.replace(cfg.duplex, **duplex))
    return cfg


def stages(**opts: Any) -> dict[str, list[StageBackend]]:
    """One TestStage per stage kind, with shared options overrides."""
    base: dict[str, Any] = {"transcript": "what is the weather like today"}
    base.update(opts)
    o = TestStageOptions(**base)
    return {
        "asr": [TestStage(o, "asr")],
        "llm": [TestStage(o, "llm")],
        "tts": [TestStage(o, "tts")],
    }


async def start_engine(
    backends: dict[str, list[StageBackend]] | None = None, **duplex: Any
) -> AsyncEngine:
    return await AsyncEngine.start(make_config(**duplex), backends or stages())


async def collect(
    engine: AsyncEngine, sid: str, until: Callable[[SessionEvent], bool], within: float = 5 * UNIT
) -> list[SessionEvent]:
    out: list[SessionEvent] = []

    async def go() -> None:
        async for ev in engine.session_events(sid):
            out.append(ev)
            if until(ev):
                return

    await asyncio.wait_for(go(), within)
    return out


@pytest.fixture(autouse=True)
def no_leaked_threads() -> Any:
    before = {t.ident for t in threading.enumerate()}
    yield
    leaked = [t for t in threading.enumerate() if t.ident not in before and t.is_alive()]
    for t in leaked:
        t.join(timeout=5)
    leaked = [t.name for t in leaked if t.is_alive()]
    assert not leaked, f"threads left behind: {leaked}"


async def aiter_list(it: AsyncIterator[Any]) -> list[Any]:
    return [x async for x in it]
