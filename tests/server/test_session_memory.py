"""Per-session memory: each bound gives its documented error or resync, what a session holds
is reported by part and comes back when it ends, sessions are counted by state, and a clean
close (1000) ends a session while a drop keeps it for the grace period."""

from __future__ import annotations

import asyncio
import gc
import json
import re
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.server.harness import (
    REALTIME_TTS,
    UNIT,
    Client,
    http_text,
    running_server,
    send_audio,
    silence,
    text_item,
    tone,
    write_config,
)
from tests.server.twilio_sim import SendAfterDrop, TwilioSim, tone8k

JOURNAL_MAX = 40_000
BACKLOG_MAX = 32_768


@pytest.fixture(scope="module")
def mem_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Small bounds, and a grace period long enough to tell a drop from an end."""
    path = write_config(
        tmp_path_factory.mktemp("mem"),
        engine={"duplex": {"disconnect_grace_s": 30, "reaper_interval_s": 0.1}},
        server={
            "journal_max_bytes": JOURNAL_MAX,
            "input_backlog_bytes": BACKLOG_MAX,
            "max_frame_bytes": 65536,
        },
    )
    with running_server(path) as addr:
        yield addr


def gauges(addr: str, name: str) -> dict[str, float]:
    text = http_text(addr, "/metrics")
    return {k: float(v) for k, v in re.findall(rf'^{name}\{{\w+="(\w+)"\}} (\S+)$', text, re.M)}


def health(addr: str) -> dict[str, int]:
    by_state: dict[str, int] = json.loads(http_text(addr, "/health"))["sessions_by_state"]
    return by_state


async def sampled(
    addr: str, ready: Callable[[dict[str, float]], bool], within: float = 5.0
) -> dict[str, float]:
    """duplex_session_bytes once ``ready`` holds for it (the engine's parts are sampled)."""
    deadline = time.monotonic() + within * UNIT
    while True:
        held = gauges(addr, "duplex_session_bytes")
        if ready(held) or time.monotonic() >= deadline:
            return held
        await asyncio.sleep(0.05)


async def settle(addr: str, want: dict[str, int], within: float = 5.0) -> None:
    """Wait until /health and duplex_sessions{state} both show ``want`` (zeros elsewhere)."""
    full = {"attached": 0, "detached": 0, "closing": 0, **want}
    deadline = time.monotonic() + within * UNIT
    while True:
        got = (health(addr), {k: int(v) for k, v in gauges(addr, "duplex_sessions").items()})
        if got == (full, full):
            return
        assert time.monotonic() < deadline, f"sessions by state {got}, want {full}"
        await asyncio.sleep(0.05)


async def all_released(addr: str, within: float = 5.0) -> dict[str, float]:
    """Every part of duplex_session_bytes back at 0 and no engine slot left."""
    deadline = time.monotonic() + within * UNIT
    while True:
        parts = gauges(addr, "duplex_session_bytes")
        slots = sum(gauges(addr, "duplex_engine_sessions").values())
        if parts and not any(parts.values()) and slots == 0:
            return parts
        assert time.monotonic() < deadline, f"still held: {parts}, engine slots {slots}"
        await asyncio.sleep(0.05)


async def resume(addr: str, created: dict[str, object], last_seq: int) -> Client:
    session = created["session"]
    assert isinstance(session, dict)
    ctx = Client.connect(addr, "?intent=resume")
    c: Client = await ctx.__aenter__()
    c.ctx = ctx  # type: ignore[attr-defined]
    await c.send(
        {
            "type": "session.resume",
            "session_id": session["id"],
            "resume_token": created["resume_token"],
            "last_received_server_event_seq": last_seq,
        }
    )
    return c


def test_a_clean_close_ends_the_session_and_a_drop_keeps_it(mem_server: str) -> None:
    async def run() -> None:
        async with Client.connect(mem_server) as a:
            created_a = await a.until("session.created")
            await settle(mem_server, {"attached": 1})
        # a normal close (1000) without session.close: ended now, not after the 30 s grace
        await settle(mem_server, {})
        await all_released(mem_server)
        c = await resume(mem_server, created_a, 1)
        err = await c.until("error")
        assert err["error"]["code"] == "session_not_found"
        await c.ctx.__aexit__(None, None, None)  # type: ignore[attr-defined]

        async with Client.connect(mem_server) as b:
            created_b = await b.until("session.created")
            b.ws.transport.abort()  # a drop: kept for a resume
        await settle(mem_server, {"detached": 1})
        assert sum(gauges(mem_server, "duplex_engine_sessions").values()) == 1
        c = await resume(mem_server, created_b, 1)
        await c.until("session.resumed")
        await settle(mem_server, {"attached": 1})
        await c.send({"type": "session.close"})
        await c.until("session.closed")
        await c.ctx.__aexit__(None, None, None)  # type: ignore[attr-defined]
        await settle(mem_server, {})
        await all_released(mem_server)

    asyncio.run(run())


def test_the_journal_bound_gives_a_resync_and_its_memory_comes_back(mem_server: str) -> None:
    async def run() -> None:
        async with Client.connect(mem_server) as a:
            created = await a.until("session.created")
            await a.send(text_item("talk"))
            await a.send({"type": "response.create"})  # ~240 kB of base64 audio, never acked
            await a.until("response.done", within=10)
            held = gauges(mem_server, "duplex_session_bytes")
            assert 0 < held["journal"] <= JOURNAL_MAX
            a.ws.transport.abort()
        c = await resume(mem_server, created, 1)  # events 2.. were dropped unacknowledged
        await c.until("session.resync_required")
        await c.until("session.resumed")
        await c.send({"type": "session.close"})
        await c.until("session.closed")
        await c.ctx.__aexit__(None, None, None)  # type: ignore[attr-defined]
        await settle(mem_server, {})
        await all_released(mem_server)

    asyncio.run(run())


def test_the_input_bounds_give_backpressure_and_their_memory_comes_back(
    mem_server: str,
) -> None:
    async def run() -> None:
        async with Client.connect(mem_server) as c:
            await c.until("session.created")
            await c.ws.send(b"\x01\x00" * (BACKLOG_MAX // 2 + 1))  # one frame over the lane
            err = await c.until("error")
            assert err["error"]["code"] == "input_backpressure"
            # the session goes on: a spoken turn is answered
            await send_audio(c, tone(600) + silence(900))
            done = await c.until("response.done", within=10)
            assert done["response"]["status"] == "completed"
            # the engine's parts are sampled every reaper_interval_s (protocol.md §8), so the
            # answer's history shows up within a few ticks of response.done, not at once
            held = await sampled(mem_server, lambda h: h.get("history", 0) > 0)
            assert held["history"] > 0 and held["input"] <= BACKLOG_MAX
            await c.send({"type": "session.close"})
            await c.until("session.closed")
        await settle(mem_server, {})
        await all_released(mem_server)

    asyncio.run(run())


def _ours(obj: object) -> str | None:
    """A name for ``obj`` if it is this server's (a class, or a frame, coroutine or task
    running code, of duplex_server / engine / duplex_contract), else None."""
    kind = type(obj)
    if kind.__module__.split(".")[0] in ("duplex_server", "engine", "duplex_contract"):
        return kind.__qualname__
    if kind in (weakref.ProxyType, weakref.CallableProxyType):
        return None  # (its referent is what counts, and it may be gone)
    if issubclass(kind, asyncio.Task):
        obj = obj.get_coro()  # type: ignore[attr-defined]
    code = getattr(obj, "f_code", None) or getattr(obj, "cr_code", None)
    code = code or getattr(obj, "ag_code", None)
    if code is not None and _OUR_CODE.search(code.co_filename):
        return f"{kind.__name__} {code.co_name}"
    return None


_OUR_CODE = re.compile(r"[/\\](duplex_server|engine|duplex_contract)[/\\]")


def test_ended_sessions_are_freed_at_once_not_by_the_cyclic_gc(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sessions that end every way (session.close, a plain close, a drop left to expire, a drop
    resumed, a Twilio call's stop, a call dropped while the server sends to it) after turns
    heard out, cancelled and barged in on leave nothing of theirs in a reference cycle. Cycles
    here once held each ended session's journal and outbox (socket -> task -> CancelledError ->
    frame -> socket; session -> input lane -> bound method -> session; engine runners and drafts
    the same way) until a full collection: the CI soak's RSS rose ~27 MB and fell every ~30 s,
    which hid real growth."""
    path = write_config(
        tmp_path,
        engine={**REALTIME_TTS, "duplex": {"disconnect_grace_s": 0.5, "reaper_interval_s": 0.1}},
    )

    async def voice_turn(c: Client) -> None:
        await send_audio(c, tone(600) + silence(800))
        await c.until("response.output_audio.delta", within=10)

    async def run(addr: str) -> None:
        async with Client.connect(addr) as a:  # heard out, a barge-in, then session.close
            await a.until("session.created")
            await a.send(text_item("talk"))
            await a.send({"type": "response.create"})
            await a.until("response.done", within=20)
            await voice_turn(a)
            await voice_turn(a)  # spoken over the answer
            await a.send({"type": "session.close"})
            await a.until("session.closed")
        async with Client.connect(addr) as b:  # cancelled, dropped, resumed, plain close
            created = await b.until("session.created")
            await b.send(text_item("talk"))
            await b.send({"type": "response.create"})
            await b.until("response.output_audio.delta")
            await b.send({"type": "response.cancel"})
            done = await b.until("response.done")
            b.ws.transport.abort()
        c = await resume(addr, created, int(done["server_event_seq"]))
        await c.until("session.resumed")
        await c.ctx.__aexit__(None, None, None)  # type: ignore[attr-defined]
        async with Client.connect(addr) as d:  # dropped mid-answer, left to expire
            await d.until("session.created")
            await voice_turn(d)
            d.ws.transport.abort()
        async with TwilioSim.call(addr, {}) as sim:  # a phone call (the media transport)
            sim.speak(tone8k(500))
            await sim.wait(lambda: len(sim.marks_echoed) >= 1, within=10)
        async with TwilioSim.call(addr, {}) as sim:  # a call dropped mid-answer
            sim.speak(tone8k(500))
            await sim.wait(lambda: len(sim.marks_in) >= 1, within=10)
            sim.ws.transport.abort()
        held.armed = True
        async with TwilioSim.call(addr, {}) as sim:  # ... while the server sends to it
            sim.speak(tone8k(500))
            await sim.wait(lambda: sim.media_in >= 2, within=10)
            sim.ws.transport.abort()
        await settle(addr, {})
        await all_released(addr)

    held = SendAfterDrop(monkeypatch)
    with running_server(path) as addr:
        gc.collect()
        gc.disable()
        try:
            asyncio.run(run(addr))
            gc.set_debug(gc.DEBUG_SAVEALL)
            gc.collect()
            cyclic = Counter(n for o in gc.garbage if (n := _ours(o)) is not None)
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
    assert held.held == 1
    assert not cyclic, f"freed only by the cyclic GC: {dict(cyclic)}"
