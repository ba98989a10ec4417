"""An engine process that restarts with its session store (docs/scale.md, "Sessions outlive
the engine"), over the real socket, in one process: the front end's ``RemoteEngine`` keeps
its session streams open while the engine is away, holds the calls made meanwhile, attaches
its sessions again to the new engine, sends the appends the old one had not saved, and the
sessions go on (the conversation, the input exactly once, ``SessionLifecycle(restored)``);
a session the new engine lacks ends; an engine that never comes back is the end."""

from __future__ import annotations

import asyncio
import shutil
import sqlite3
import tempfile
from pathlib import Path

import msgspec
import pytest

from duplex_contract.control import AppendCall, CommitCall, OpenCall, ResumeCall
from duplex_contract.errors import EngineDeadError
from duplex_contract.session_events import ResponseDone, SessionEvent, SessionLifecycle, TextDelta
from duplex_contract.settings import SessionSettings
from engine.api.remote import EngineServer
from engine.api.remote_client import RemoteEngine
from engine.config import EngineConfig
from tests.engine.conftest import UNIT, make_config, run, stages

TEXT = SessionSettings(output_modalities=("text",))


def _config(store: Path | None) -> EngineConfig:
    cfg = make_config()
    duplex = msgspec.structs.replace(cfg.duplex, store_path=str(store) if store else None)
    return msgspec.structs.replace(cfg, duplex=duplex)


async def _start(cfg: EngineConfig, addr: str) -> EngineServer:
    server = EngineServer(cfg, stages(echo_prompt=True), stats_interval_s=0.05)
    await server.start(addr)
    return server


async def _until(events: asyncio.Queue[SessionEvent], kind: type, within: float = 5.0) -> object:
    while True:
        event = await asyncio.wait_for(events.get(), within * UNIT)
        if isinstance(event, kind):
            return event


async def _answer(
    engine: RemoteEngine, sid: str, gen: int, text: str, q: asyncio.Queue[SessionEvent]
) -> str:
    """A text turn (``text``, committed with a response); the answer's text."""
    fence = (await engine.call(ResumeCall(sid, 0, peek=True))).accepted_fence
    assert fence is not None
    await engine.call(AppendCall(fence=fence, lease_generation=gen, text=text))
    await engine.call(CommitCall(fence=fence, lease_generation=gen))
    parts: list[str] = []
    while True:
        event = await asyncio.wait_for(q.get(), 5 * UNIT)
        if isinstance(event, TextDelta):
            parts.append(event.text)
        if isinstance(event, ResponseDone):
            assert event.status == "completed", event
            return "".join(parts)


def test_a_restarted_engine_takes_its_sessions_back() -> None:
    async def main() -> None:
        tmp = Path(tempfile.mkdtemp(prefix="dx-"))
        addr = f"unix://{tmp}/engine.sock"
        cfg = _config(tmp / "sessions.db")
        server = await _start(cfg, addr)
        engine = await RemoteEngine.connect(addr, name="fe", restart_s=30)
        events: asyncio.Queue[SessionEvent] = asyncio.Queue()

        async def pump(sid: str) -> None:
            async for event in engine.session_events(sid):
                await events.put(event)

        try:
            res = await engine.call(OpenCall(config=TEXT, operation_id="o1"))
            sid = res.session_id
            assert sid is not None and res.saved
            reader = asyncio.create_task(pump(sid))
            assert "alpha" in await _answer(engine, sid, 1, "alpha", events)
            fence = (await engine.call(ResumeCall(sid, 0, peek=True))).accepted_fence
            assert fence is not None
            one = AppendCall(fence=fence, lease_generation=1, audio=b"\1\0" * 160, seq=1)
            assert not (await engine.call(one)).saved  # the front end keeps it
            await server.stop()  # the engine goes away (its store stays)
            await asyncio.sleep(0.2)
            assert engine.restarting and not engine.ready
            two = AppendCall(fence=fence, lease_generation=1, audio=b"\2\0" * 160, seq=2)
            held = asyncio.create_task(engine.call(two))  # waits for the engine
            await asyncio.sleep(0.3)
            assert not held.done()
            server = await _start(cfg, addr)  # a new engine process, the same store
            assert (await asyncio.wait_for(held, 10 * UNIT)).ok
            assert engine.ready and not engine.restarting
            restored = await _until(events, SessionLifecycle)
            assert restored == SessionLifecycle(sid, "restored", "engine_restarted")
            assert server.engine is not None
            kept = server.engine.orchestrator.control.sessions[sid]
            assert bytes(kept.audio) == b"\1\0" * 160 + b"\2\0" * 160  # each append once
            assert kept.last_seq == 2 and kept.lease.detached_at is None
            # the conversation went on: the next answer's prompt holds the first turn
            answer = await _answer(engine, sid, 1, "bravo", events)
            assert "alpha" in answer and "bravo" in answer, answer
            reader.cancel()
        finally:
            await engine.shutdown()
            await server.stop()
            shutil.rmtree(tmp, ignore_errors=True)

    run(main())


def test_a_session_the_restarted_engine_lacks_ends_and_the_others_go_on() -> None:
    async def main() -> None:
        tmp = Path(tempfile.mkdtemp(prefix="dx-"))
        addr = f"unix://{tmp}/engine.sock"
        cfg = _config(tmp / "sessions.db")
        server = await _start(cfg, addr)
        engine = await RemoteEngine.connect(addr, name="fe", restart_s=30)
        try:
            kept = (await engine.call(OpenCall(config=TEXT))).session_id
            gone = (await engine.call(OpenCall(config=TEXT))).session_id
            assert kept and gone
            await server.stop()
            with sqlite3.connect(tmp / "sessions.db") as db:  # lost with the old engine
                db.execute("DELETE FROM sessions WHERE id = ?", (gone,))
            server = await _start(cfg, addr)
            with pytest.raises(EngineDeadError, match="lost session"):
                async for _ in engine.session_events(gone):
                    pass
            first = await asyncio.wait_for(anext(engine.session_events(kept)), 10 * UNIT)
            assert isinstance(first, SessionLifecycle) and first.state == "restored"
        finally:
            await engine.shutdown()
            await server.stop()
            shutil.rmtree(tmp, ignore_errors=True)

    run(main())


def test_without_a_store_or_a_return_the_engine_is_dead() -> None:
    async def main() -> None:
        tmp = Path(tempfile.mkdtemp(prefix="dx-"))
        addr = f"unix://{tmp}/engine.sock"
        try:
            for cfg, restart_s in ((_config(None), 30.0), (_config(tmp / "s.db"), 0.5)):
                server = await _start(cfg, addr)
                engine = await RemoteEngine.connect(addr, name="fe", restart_s=restart_s)
                await engine.call(OpenCall())
                await server.stop()  # and no engine comes back
                with pytest.raises(EngineDeadError):
                    await asyncio.wait_for(engine.call(OpenCall()), 10 * UNIT)
                assert not engine.restarting
                await engine.shutdown()
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    run(main())


def test_a_call_that_finds_the_link_broken_before_its_reader_does_waits_for_the_engine() -> None:
    """A killed engine: a write fails (the transport closes at once) while the reader has not
    seen it yet; a call made in that window finds the engine restarting, not dead (before,
    a front end whose sessions were sending audio then died with its engine)."""

    async def main() -> None:
        tmp = Path(tempfile.mkdtemp(prefix="dx-"))
        addr = f"unix://{tmp}/engine.sock"
        server = await _start(_config(tmp / "sessions.db"), addr)
        engine = await RemoteEngine.connect(addr, name="fe", restart_s=30)
        events: asyncio.Queue[SessionEvent] = asyncio.Queue()

        async def pump(sid: str) -> None:
            async for event in engine.session_events(sid):
                await events.put(event)

        try:
            sid = (await engine.call(OpenCall(config=TEXT))).session_id
            assert sid is not None
            reader = asyncio.create_task(pump(sid))
            fence = (await engine.call(ResumeCall(sid, 0, peek=True))).accepted_fence
            assert fence is not None
            engine.reconnecting._link._writer.transport.abort()  # as a failed write does
            call = asyncio.create_task(
                engine.call(AppendCall(fence=fence, lease_generation=1, text="alpha"))
            )
            await asyncio.sleep(0)  # the call is sent before the reader runs
            assert engine.inbox.dead is None and engine.restarting
            assert (await asyncio.wait_for(call, 10 * UNIT)).ok  # once the link is back
            assert engine.ready and engine.reconnecting.restarts == 1
            assert "alpha" in await _answer(engine, sid, 1, "bravo", events)
            reader.cancel()
        finally:
            await engine.shutdown()
            await server.stop()
            shutil.rmtree(tmp, ignore_errors=True)

    run(main())
