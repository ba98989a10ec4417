"""Engine fixtures: an AsyncEngine on the deterministic test stage."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from duplex_contract.session_events import SessionEvent
from engine.api.client import AsyncEngine
from engine.api.remote import EngineServer
from engine.api.remote_client import RemoteEngine
from engine.config import EngineConfig, load_engine_config
from engine.orchestration.orchestrator import Orchestrator
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


_MODE = ["inproc"]


@pytest.fixture(params=["inproc", "socket"])
def transport(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run a test over both engine transports: in-process (janus queues) and an engine
    server behind a Unix socket with a RemoteEngine front end (same process, same backends,
    so tests can still look at the stage objects)."""
    _MODE[0] = request.param
    try:
        yield request.param
    finally:
        _MODE[0] = "inproc"


class LoopbackEngine(RemoteEngine):
    """A RemoteEngine that owns the EngineServer it talks to (tests only); its
    ``orchestrator`` is the server's (tests look inside it, as with an AsyncEngine)."""

    server: EngineServer
    tmp: str
    orchestrator: Orchestrator

    @classmethod
    async def open(
        cls, config: EngineConfig, backends: dict[str, list[StageBackend]] | None
    ) -> LoopbackEngine:
        tmp = tempfile.mkdtemp(prefix="dx-")
        server = EngineServer(config, backends, stats_interval_s=0.1)
        address = await server.start(f"unix://{tmp}/engine.sock")
        engine = await cls.connect(str(address), name="test")
        assert isinstance(engine, LoopbackEngine)
        engine.server, engine.tmp = server, tmp
        assert server.engine is not None
        engine.orchestrator = server.engine.orchestrator
        return engine

    async def shutdown(self) -> None:
        await super().shutdown()
        await self.server.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)


async def open_engine(
    config: EngineConfig, backends: dict[str, list[StageBackend]] | None = None
) -> AsyncEngine:
    """Start an engine on the transport of the ``transport`` fixture (in-process without it)."""
    if _MODE[0] == "socket":
        return await LoopbackEngine.open(config, backends)
    return await AsyncEngine.start(config, backends)


async def start_engine(
    backends: dict[str, list[StageBackend]] | None = None, **duplex: Any
) -> AsyncEngine:
    return await open_engine(make_config(**duplex), backends or stages())


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
