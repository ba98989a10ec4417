"""Realtime server benchmark: barge-in stop latency, stale bytes, per-chunk overhead, capacity.

Starts the real server (``duplex-server serve``) on loopback with the test stage speaking in
real time, then drives it with real WebSocket clients:

1. barge-in: a client starts a response, and after its second audio delta sends
   ``response.cancel``; latency = cancel sent -> ``response.done{cancelled}`` received;
   stale bytes = audio bytes of that response received after it (must be 0).
2. load: N clients each stream audio in real time (40 ms base64 appends, server VAD on) and
   keep a spoken response running; the server-added latency per audio chunk (engine chunk
   received by the server -> frame written to the socket) is read from the server's own
   ``duplex_chunk_overhead_seconds`` histogram over that step. The largest N whose p99 stays
   <= 10 ms with every client healthy is ``max_sessions_realtime``.

Usage: ``python bench/realtime.py [--sessions N] [--quick] [--json PATH]``
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import websockets
import yaml

ROOT = Path(__file__).resolve().parents[1]
CHUNK_MS = 40
SILENCE = base64.b64encode(b"\x00\x00" * (24000 * CHUNK_MS // 1000)).decode()
HIST = "duplex_chunk_overhead_seconds"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_config(tmp: Path, max_sessions: int) -> Path:
    raw = yaml.safe_load((ROOT / "configs" / "test.yaml").read_text())
    raw["engine"]["stages"]["tts"]["options"] = {"realtime": True}
    raw["engine"]["duplex"] = {"max_sessions": max_sessions}
    raw["server"] = {}
    path = tmp / "bench.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@contextlib.contextmanager
def server_process(config: Path) -> Any:
    port = free_port()
    exe = Path(sys.executable).with_name("duplex-server")
    cmd = [
        str(exe),
        "serve",
        "--config",
        str(config),
        "--port",
        str(port),
        "--log-level",
        "warning",
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    addr = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"http://{addr}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            time.sleep(0.1)
        else:
            raise RuntimeError("server did not become ready")
        yield addr
    finally:
        proc.terminate()
        proc.wait(30)


def scrape(addr: str) -> dict[float, float]:
    """Cumulative bucket counts of the chunk-overhead histogram."""
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[float, float] = {}
    for line in text.splitlines():
        if line.startswith(f"{HIST}_bucket"):
            le = line.split('le="')[1].split('"')[0]
            out[float("inf") if le == "+Inf" else float(le)] = float(line.rsplit(" ", 1)[1])
    return out


def quantile(before: dict[float, float], after: dict[float, float], q: float) -> float:
    """histogram_quantile over the difference of two scrapes (linear within a bucket)."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    total = counts[-1] if counts else 0.0
    if total <= 0:
        return float("nan")
    rank = q * total
    prev_b, prev_c = 0.0, 0.0
    for b, c in zip(bounds, counts, strict=True):
        if c >= rank:
            if b == float("inf"):
                return prev_b
            return prev_b + (b - prev_b) * (rank - prev_c) / max(c - prev_c, 1e-9)
        prev_b, prev_c = b, c
    return bounds[-2]


async def start_response(ws: Any) -> None:
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "go"}]}
    await ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
    await ws.send(json.dumps({"type": "response.create"}))


async def one_bargein(addr: str) -> tuple[float, int]:
    async with websockets.connect(f"ws://{addr}/v1/realtime", max_size=None) as ws:
        await ws.recv()
        await start_response(ws)
        deltas = 0
        rid = None
        while deltas < 2:
            ev = json.loads(await ws.recv())
            if ev["type"] == "response.output_audio.delta":
                deltas += 1
                rid = ev["response_id"]
        t0 = time.perf_counter()
        await ws.send(json.dumps({"type": "response.cancel"}))
        while True:
            ev = json.loads(await ws.recv())
            if ev["type"] == "response.done" and ev["response"]["status"] == "cancelled":
                t1 = time.perf_counter()
                break
        stale = 0
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(0.5):
                while True:
                    ev = json.loads(await ws.recv())
                    if ev["type"] == "response.output_audio.delta" and ev["response_id"] == rid:
                        stale += len(base64.b64decode(ev["delta"]))
        return (t1 - t0) * 1000.0, stale


async def load_client(addr: str, seconds: float, stats: dict[str, int]) -> None:
    try:
        async with websockets.connect(f"ws://{addr}/v1/realtime", max_size=None) as ws:
            await ws.recv()
            await start_response(ws)

            async def reader() -> None:
                async for data in ws:
                    ev = json.loads(data)
                    if ev["type"] == "response.output_audio.delta":
                        stats["audio"] += 1
                    elif ev["type"] == "response.done":
                        await start_response(ws)
                    elif ev["type"] == "error":
                        stats["errors"] += 1

            task = asyncio.create_task(reader())
            start = time.perf_counter()
            n = 0
            while (elapsed := time.perf_counter() - start) < seconds:
                await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": SILENCE}))
                n += 1
                await asyncio.sleep(max(0.0, n * CHUNK_MS / 1000 - elapsed))
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            stats["ok"] += 1
    except (OSError, websockets.WebSocketException):
        stats["failed"] += 1


async def load_step(addr: str, n: int, seconds: float) -> dict[str, Any]:
    stats = {"ok": 0, "failed": 0, "errors": 0, "audio": 0}
    before = scrape(addr)
    clients = []
    for _ in range(n):  # ramp: ~200 connects per second
        clients.append(asyncio.create_task(load_client(addr, seconds, stats)))
        await asyncio.sleep(0.005)
    await asyncio.gather(*clients)
    after = scrape(addr)
    return {
        "sessions": n,
        "p50_ms": quantile(before, after, 0.5) * 1000,
        "p99_ms": quantile(before, after, 0.99) * 1000,
        **stats,
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    quick = args.quick
    steps = [25, 50, 100, 200] if quick else [50, 100, 200, 300, 400, 500, 600, 800]
    if args.sessions:
        steps = [s for s in steps if s < args.sessions] + [args.sessions]
    with tempfile.TemporaryDirectory() as tmp:
        config = write_config(Path(tmp), max(steps) + 50)
        with server_process(config) as addr:
            trials = [await one_bargein(addr) for _ in range(10 if quick else 40)]
            lat = sorted(t[0] for t in trials)
            result: dict[str, Any] = {
                "bargein_ms_p50": statistics.median(lat),
                "bargein_ms_p99": lat[min(len(lat) - 1, int(0.99 * len(lat)))],
                "stale_bytes": sum(t[1] for t in trials),
                "bargein_trials": len(trials),
            }
            seconds = 3.0 if quick else 8.0
            table = []
            best = 0
            for n in steps:
                row = await load_step(addr, n, seconds)
                table.append(row)
                print(
                    f"  {n:4d} sessions: chunk overhead p50 {row['p50_ms']:.2f} ms"
                    f" p99 {row['p99_ms']:.2f} ms, ok {row['ok']}, failed {row['failed']},"
                    f" errors {row['errors']}, audio deltas {row['audio']}",
                    flush=True,
                )
                healthy = row["failed"] == 0 and row["errors"] == 0 and row["ok"] == n
                if healthy and row["p99_ms"] <= 10.0:
                    best = n
                else:
                    break
            result["chunk_overhead_ms_p99"] = next(
                (r["p99_ms"] for r in table if r["sessions"] == best), table[0]["p99_ms"]
            )
            result["chunk_overhead_ms_p50"] = next(
                (r["p50_ms"] for r in table if r["sessions"] == best), table[0]["p50_ms"]
            )
            result["max_sessions_realtime"] = best
            result["load_steps"] = table
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=0, help="largest load step to try")
    parser.add_argument("--quick", action="store_true", help="fewer trials, shorter steps")
    parser.add_argument("--json", type=Path, default=None, help="write results here")
    args = parser.parse_args()
    result = asyncio.run(run(args))
    print(f"barge-in stop latency p50 {result['bargein_ms_p50']:.2f} ms")
    print(f"barge-in stop latency p99 {result['bargein_ms_p99']:.2f} ms")
    print(f"stale audio bytes after response.done{{cancelled}}: {result['stale_bytes']}")
    print(f"server-added latency per audio chunk p99: {result['chunk_overhead_ms_p99']:.3f} ms")
    print(f"max sessions with p99 <= 10 ms: {result['max_sessions_realtime']}")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
