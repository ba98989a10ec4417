"""The engine in its own process (`duplex-server engine`) behind two front ends
(`duplex-server serve --engine`), all real processes on 127.0.0.1 with real clients.

Engine death mid-reply: every front end tells its clients (`error` engine_unavailable, close
1011) and `/health` turns 503; nothing hangs. Front-end death: its sessions are detached in
the engine, expire after the grace period, and their slots serve new sessions.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import websockets

from tests.server.harness import (
    REALTIME_TTS,
    Client,
    http_status,
    http_text,
    text_item,
    write_config,
)

PY = [sys.executable, "-m", "duplex_server"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(check: object, within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@contextlib.contextmanager
def topology(
    config: Path, fronts: int = 2
) -> Iterator[tuple[subprocess.Popen[bytes], list[tuple[subprocess.Popen[bytes], str]]]]:
    tmp = tempfile.mkdtemp(prefix="dx-")
    addr = f"unix://{tmp}/engine.sock"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        engine = subprocess.Popen(
            [*PY, "engine", "--config", str(config), "--listen", addr, "--log-level", "warning"]
        )
        procs.append(engine)
        front: list[tuple[subprocess.Popen[bytes], str]] = []
        for _ in range(fronts):
            port = free_port()
            proc = subprocess.Popen(
                [
                    *PY,
                    "serve",
                    "--config",
                    str(config),
                    "--port",
                    str(port),
                    "--engine",
                    addr,
                    "--log-level",
                    "warning",
                ]
            )
            procs.append(proc)
            front.append((proc, f"127.0.0.1:{port}"))
        for _, hp in front:
            wait_for(lambda hp=hp: _status(hp) == 200, 60, f"front end {hp} ready")
        yield engine, front
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        with contextlib.suppress(OSError):
            os.unlink(f"{tmp}/engine.sock")
        with contextlib.suppress(OSError):
            os.rmdir(tmp)


def _status(hp: str) -> int:
    try:
        return http_status(hp, "/health")
    except OSError:
        return 0


def engine_sessions(hp: str) -> dict[str, float]:
    body = http_text(hp, "/metrics")
    return {
        m.group(1): float(m.group(2))
        for m in re.finditer(r'duplex_engine_sessions\{state="(\w+)"\} ([0-9.e+]+)', body)
    }


def test_sessions_on_two_front_ends_and_engine_death_mid_reply(tmp_path: Path) -> None:
    config = write_config(tmp_path, engine=REALTIME_TTS)
    with topology(config) as (engine, front):

        async def talk(stack: contextlib.AsyncExitStack, hp: str) -> Client:
            c: Client = await stack.enter_async_context(Client.connect(hp))
            await c.until("session.created")
            await c.send(text_item("hello"))
            await c.send({"type": "response.create"})
            await c.until("response.output_audio.delta", within=10.0)
            return c

        async def run() -> None:
            async with contextlib.AsyncExitStack() as stack:
                clients = [await talk(stack, hp) for _, hp in front for _ in range(2)]
                # both front ends see the engine-wide count: 4 sessions, 2 from each
                for _, hp in front:
                    wait_for(lambda hp=hp: engine_sessions(hp).get("open") == 4, 5, "4 open")
                engine.send_signal(signal.SIGKILL)  # mid-reply
                for c in clients:
                    error = await c.until("error", within=10.0)
                    assert error["error"]["code"] == "engine_unavailable", error
                    try:
                        await asyncio.wait_for(c.ws.recv(), 5)
                        raise AssertionError("the socket stayed open")
                    except websockets.ConnectionClosed as exc:
                        assert exc.rcvd is not None and exc.rcvd.code == 1011

        asyncio.run(run())
        for _, hp in front:
            wait_for(lambda hp=hp: _status(hp) == 503, 5, "health 503")
            assert "engine gone" in http_text_any(hp, "/health")


def http_text_any(hp: str, path: str) -> str:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://{hp}{path}", timeout=5) as resp:
            return str(resp.read().decode())
    except urllib.error.HTTPError as exc:
        return str(exc.read().decode())


def test_a_dead_front_end_frees_its_sessions_after_the_grace_period(tmp_path: Path) -> None:
    config = write_config(
        tmp_path, engine={"duplex": {"max_sessions": 2, "disconnect_grace_s": 1.0}}
    )
    with topology(config) as (_engine, front):
        (victim, hp_dead), (_, hp_live) = front

        async def hold_two() -> None:
            async with Client.connect(hp_dead) as a, Client.connect(hp_dead) as b:
                await a.until("session.created")
                await b.until("session.created")
                wait_for(lambda: engine_sessions(hp_live).get("open") == 2, 5, "2 open")
                victim.send_signal(signal.SIGKILL)
                victim.wait(5)

        with contextlib.suppress(websockets.ConnectionClosed, OSError):
            asyncio.run(hold_two())
        # detached in the engine, then expired after the grace period: slots come back
        wait_for(lambda: engine_sessions(hp_live).get("detached", 0) == 2, 5, "2 detached")
        wait_for(lambda: sum(engine_sessions(hp_live).values()) == 0, 10, "slots freed")

        async def two_more() -> None:
            async with Client.connect(hp_live) as a, Client.connect(hp_live) as b:
                for c in (a, b):
                    created = await c.until("session.created")
                    assert created["session"]["id"].startswith("sess_")
                await a.send(text_item("hi"))
                await a.send({"type": "response.create"})
                done = await a.until("response.done", within=10.0)
                assert done["response"]["status"] == "completed"

        asyncio.run(two_more())
