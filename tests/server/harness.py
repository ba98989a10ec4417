"""Real servers on 127.0.0.1:0 for end-to-end tests, and a small WebSocket client helper.

Timeouts are multiples of ``UNIT`` (env ``DUPLEX_TEST_UNIT``, default 1.0 s) so slow CI can
scale them all at once.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import math
import os
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import uvicorn
import websockets
import yaml

from duplex_server.app import create_app
from duplex_server.config import load_app_config

UNIT = float(os.environ.get("DUPLEX_TEST_UNIT", "1.0"))
ROOT = Path(__file__).resolve().parents[2]
TEST_YAML = ROOT / "configs" / "test.yaml"


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def write_config(
    tmp: Path, engine: dict[str, Any] | None = None, server: dict[str, Any] | None = None
) -> Path:
    """configs/test.yaml with overrides, written to ``tmp/config.yaml``."""
    raw = yaml.safe_load(TEST_YAML.read_text())
    raw = _merge(raw, {"engine": engine or {}, "server": server or {}})
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


#: a TTS that speaks in real time, so responses last long enough to interrupt
REALTIME_TTS = {"stages": {"tts": {"backend": "test", "options": {"realtime": True}}}}


@contextlib.contextmanager
def running_server(
    config_path: Path, ready_s: float = 20.0, apps: list[Any] | None = None
) -> Iterator[str]:
    """Start the real app under uvicorn on a free port; yield ``host:port``; stop it.
    ``apps``: the app is appended to it (for tests that look inside the server)."""
    config = load_app_config(config_path)
    app = create_app(config)
    if apps is not None:
        apps.append(app)
    uv_config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=0,
        log_level="warning",
        ws="websockets-sansio",
        ws_max_size=config.server.max_frame_bytes + 1024 * 1024,
        lifespan="on",
    )
    server = uvicorn.Server(uv_config)
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + ready_s * UNIT
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        addr = f"127.0.0.1:{port}"
        while http_status(addr, "/health") != 200:
            if time.monotonic() > deadline:
                raise RuntimeError("engine did not become ready")
            time.sleep(0.02)
        yield addr
    finally:
        server.should_exit = True
        thread.join(30 * UNIT)


def http_status(addr: str, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://{addr}{path}", timeout=5 * UNIT) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def http_text(addr: str, path: str) -> str:
    with urllib.request.urlopen(f"http://{addr}{path}", timeout=5 * UNIT) as resp:
        return str(resp.read().decode())


class Client:
    """A real ``websockets`` client that records every server event it receives."""

    def __init__(self, ws: websockets.ClientConnection) -> None:
        self.ws = ws
        self.events: list[dict[str, Any]] = []

    @classmethod
    @contextlib.asynccontextmanager
    async def connect(cls, addr: str, query: str = "", **kw: Any) -> Any:
        url = f"ws://{addr}/v1/realtime{query}"
        async with websockets.connect(url, max_size=None, **kw) as ws:
            yield cls(ws)

    async def send(self, obj: dict[str, Any]) -> None:
        await self.ws.send(json.dumps(obj))

    async def recv(self, within: float = 5.0) -> dict[str, Any]:
        data = await asyncio.wait_for(self.ws.recv(), within * UNIT)
        event: dict[str, Any] = json.loads(data)
        self.events.append(event)
        return event

    async def until(self, kind: str, within: float = 5.0) -> dict[str, Any]:
        deadline = time.monotonic() + within * UNIT
        while True:
            event = await self.recv(max(0.01, deadline - time.monotonic()))
            if event["type"] == kind:
                return event

    async def drain(self, seconds: float) -> list[dict[str, Any]]:
        """Everything that arrives within ``seconds`` (used to assert silence)."""
        got: list[dict[str, Any]] = []
        deadline = time.monotonic() + seconds
        with contextlib.suppress(TimeoutError):
            while (left := deadline - time.monotonic()) > 0:
                got.append(await self.recv(left / UNIT))
        return got

    async def closed(self, within: float = 5.0) -> int | None:
        """Wait for the server to close; returns its close code."""
        with contextlib.suppress(websockets.ConnectionClosed):
            while True:
                await self.recv(within)
        return self.ws.close_code


def tone(ms: float, rate: int = 24000, amp: float = 0.3, hz: float = 300.0) -> bytes:
    n = int(rate * ms / 1000)
    t = np.arange(n) / rate
    return (np.sin(2 * math.pi * hz * t) * amp * 32767).astype("<i2").tobytes()


def silence(ms: float, rate: int = 24000) -> bytes:
    return b"\x00\x00" * int(rate * ms / 1000)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


async def send_audio(client: Client, pcm: bytes, chunk_ms: float = 40, rate: int = 24000) -> None:
    step = int(rate * chunk_ms / 1000) * 2
    for i in range(0, len(pcm), step):
        await client.send({"type": "input_audio_buffer.append", "audio": b64(pcm[i : i + step])})


def text_item(text: str) -> dict[str, Any]:
    return {
        "type": "conversation.item.create",
        "item": {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": text}],
        },
    }
