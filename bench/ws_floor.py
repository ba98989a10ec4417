"""Transport floor: what the same client load costs a bare uvicorn + Starlette WebSocket app.

``bench/realtime.py`` measures how many live sessions one duplex-server front end holds.
This bench measures the part of that cost no session server built on uvicorn can avoid:
the same load clients (``realtime.LoadClient``: real-time 20 ms binary PCM16 frames) against
an app that accepts the socket, says ``session.created`` and then only *receives* frames (no
decoding, no VAD, no engine); with ``--speak`` it also sends each client a 100 ms audio delta
every 100 ms once asked for a response, as the test stage's spoken answer does. It is served
by uvicorn exactly as ``duplex-server serve`` serves (the same WebSocket protocol class), so
the difference between the two benches is what duplex-server itself adds per session.

Usage: ``python bench/ws_floor.py [--sessions 100,150,300] [--seconds 8] [--speak]
[--json PATH]``. JSON: ``steps`` (per N: server and client CPU %, server CPU ms per
session-second, frames received and sent).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from realtime import LoadClient, _frame, _text, audio_chunk, cpu_seconds

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

APP = """
import sys
import uvicorn
from starlette.applications import Starlette
from starlette.routing import Route, WebSocketRoute
from starlette.responses import PlainTextResponse
from duplex_server.transports.ws_protocol import BufferedReadsProtocol

import asyncio, base64, json

frames = 0
DELTA = json.dumps({"type": "response.output_audio.delta", "response_id": "resp_1",
                    "delta": base64.b64encode(bytes(4800)).decode()}, separators=(",", ":"))

async def speak(ws):
    # what the test stage's spoken answer costs to send: a 100 ms delta every 100 ms
    while True:
        await ws.send_text(DELTA)
        await asyncio.sleep(0.1)

async def realtime(ws):
    global frames
    await ws.accept()
    await ws.send_text('{"type":"session.created"}')
    sender = None
    try:
        while True:
            msg = await ws.receive()
            if msg["type"] == "websocket.disconnect":
                return
            frames += 1
            text = msg.get("text")
            if text is not None and '"response.create"' in text and SEND and sender is None:
                sender = asyncio.create_task(speak(ws))
            if text is not None and '"session.close"' in text:
                await ws.close()
                return
    finally:
        if sender is not None:
            sender.cancel()

async def count(request):
    return PlainTextResponse(str(frames))

app = Starlette(routes=[WebSocketRoute("/v1/realtime", realtime), Route("/frames", count)])
SEND = sys.argv[2] == "1"
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning",
            ws=BufferedReadsProtocol, ws_ping_interval=20.0, ws_ping_timeout=20.0)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def frames(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/frames", timeout=10) as r:
        return int(r.read())


async def client(addr: str, seconds: float, chunk: bytes, stats: dict[str, int]) -> None:
    loop = asyncio.get_running_loop()
    host, port = addr.rsplit(":", 1)
    opened: asyncio.Future[None] = loop.create_future()
    _, proto = await loop.create_connection(lambda: LoadClient(stats, opened), host, int(port))
    proto.send(
        (
            f"GET /v1/realtime HTTP/1.1\r\nHost: {addr}\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {proto.key}\r\n"
            "Sec-WebSocket-Version: 13\r\n\r\n"
        ).encode()
    )
    async with asyncio.timeout(10):
        await opened
    start = time.perf_counter()
    n = 0
    while (elapsed := time.perf_counter() - start) < seconds and not proto.broken:
        proto.send(_frame(chunk[0], chunk[1:]))
        n += 1
        await asyncio.sleep(max(0.0, n * 0.020 - elapsed))
    stats["sent"] += n
    proto.ending = True
    proto.send(_text({"type": "session.close"}))
    try:
        async with asyncio.timeout(5):
            await proto.closed
    except TimeoutError:
        pass
    stats["failed" if proto.broken else "ok"] += 1


async def step(port: int, pid: int, n: int, seconds: float) -> dict[str, Any]:
    stats = {"ok": 0, "failed": 0, "errors": 0, "audio": 0, "sent": 0}
    chunk = audio_chunk(20, True)
    f0 = frames(port)
    t0, own0, cpu0 = time.perf_counter(), time.process_time(), cpu_seconds(pid)
    tasks = []
    for _ in range(n):
        tasks.append(asyncio.create_task(client(f"127.0.0.1:{port}", seconds, chunk, stats)))
        await asyncio.sleep(0.005)
    await asyncio.gather(*tasks)
    wall = time.perf_counter() - t0
    server_cpu = cpu_seconds(pid) - cpu0
    got = frames(port) - f0
    return {
        "sessions": n,
        "ok": stats["ok"],
        "failed": stats["failed"],
        "frames_sent": stats["sent"],
        "frames_received": got,
        "audio_deltas_received": stats["audio"],
        "server_cpu_pct": round(100 * server_cpu / wall, 1),
        "server_cpu_ms_per_session_s": round(1000 * server_cpu / (n * seconds), 2),
        "client_cpu_pct": round(100 * (time.process_time() - own0) / wall, 1),
        "loadavg_1m": os.getloadavg()[0],
    }


async def run(port: int, pid: int, sizes: list[int], seconds: float) -> list[dict[str, Any]]:
    for _ in range(100):
        try:
            frames(port)
            break
        except OSError:
            await asyncio.sleep(0.1)
    rows = []
    for n in sizes:
        row = await step(port, pid, n, seconds)
        rows.append(row)
        print(
            f"  {n:4d} sessions: server {row['server_cpu_pct']}% "
            f"({row['server_cpu_ms_per_session_s']} ms per session-second), "
            f"client {row['client_cpu_pct']}%, frames {row['frames_received']}"
            f"/{row['frames_sent']}, audio deltas {row['audio_deltas_received']}, "
            f"ok {row['ok']}, failed {row['failed']}, "
            f"load {row['loadavg_1m']:.2f}",
            flush=True,
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", default="100,150,300", help="comma-separated steps")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--speak",
        action="store_true",
        help="also send each client a 100 ms audio delta every 100 ms (as the test stage does)",
    )
    args = parser.parse_args()
    sizes = [int(s) for s in args.sessions.split(",")]
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", APP, str(port), "1" if args.speak else "0"], env=env
    )
    try:
        rows = asyncio.run(run(port, proc.pid, sizes, args.seconds))
    finally:
        proc.terminate()
        proc.wait(10)
    if args.json is not None:
        args.json.write_text(
            json.dumps({"frame_ms": 20, "speak": args.speak, "steps": rows}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
