"""What a remote LLM stage costs a user: TTFA with the LLM in-process vs behind HTTP.

    python bench/remote_overhead.py [--turns N] [--json PATH]

Two servers run the same deterministic test stages (configs/test.yaml): *local* with the LLM
in-process, *remote* with its LLM stage on ``backend: openai`` pointed at a second
duplex-server's ``/v1/chat/completions`` (streamed SSE over loopback HTTP). A real
WebSocket client speaks a voice turn (tone, then silence; server VAD) and times the moment
it receives ``input_audio_buffer.speech_stopped`` to the first ``response.output_audio.delta``.
Turns alternate between the two servers, so both see the same machine load.

JSON key: ``remote_ttfa_overhead_ms_p50`` (remote p50 - local p50). Target <= 30 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import websockets
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serverproc import ROOT, running_server


def tone(ms: float, rate: int = 24000) -> bytes:
    t = np.arange(int(rate * ms / 1000)) / rate
    return (np.sin(2 * math.pi * 300 * t) * 0.3 * 32767).astype("<i2").tobytes()


async def voice_turn(addr: str) -> float:
    """Seconds from speech_stopped (as the client sees it) to the first audio delta."""
    async with websockets.connect(f"ws://{addr}/v1/realtime", max_size=None) as ws:
        await ws.recv()  # session.created
        pcm = tone(600) + bytes(2 * 24 * 900)
        step = 2 * 24 * 40
        for i in range(0, len(pcm), step):
            chunk = base64.b64encode(pcm[i : i + step]).decode()
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": chunk}))
        stopped = 0.0
        while True:
            event = json.loads(await asyncio.wait_for(ws.recv(), 30))
            if event["type"] == "input_audio_buffer.speech_stopped":
                stopped = time.perf_counter()
            elif event["type"] == "response.output_audio.delta":
                return time.perf_counter() - stopped


def configs(tmp: Path, remote_port: int) -> tuple[Path, Path]:
    raw = yaml.safe_load((ROOT / "configs" / "test.yaml").read_text())
    local = tmp / "local.yaml"
    local.write_text(yaml.safe_dump(raw))
    raw["engine"]["stages"]["llm"] = {
        "backend": "openai",
        "options": {"base_url": f"http://127.0.0.1:{remote_port}/v1", "model": "duplex"},
    }
    remote = tmp / "front.yaml"
    remote.write_text(yaml.safe_dump(raw))
    return local, remote


async def measure(local: str, front: str, turns: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"local": [], "remote": []}
    for _ in range(2):  # warm-up
        await voice_turn(local)
        await voice_turn(front)
    for i in range(turns):
        order = [("local", local), ("remote", front)]
        for name, addr in order if i % 2 == 0 else reversed(order):
            out[name].append(await voice_turn(addr))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        with running_server(ROOT / "configs" / "test.yaml") as (remote_addr, _):
            port = int(remote_addr.rsplit(":", 1)[1])
            local_cfg, front_cfg = configs(tmp, port)
            with running_server(local_cfg) as (local, _), running_server(front_cfg) as (front, _):
                times = asyncio.run(measure(local, front, args.turns))
    ms = {k: [v * 1000 for v in vs] for k, vs in times.items()}
    fig: dict[str, Any] = {
        name: {
            "p50_ms": statistics.median(vs),
            "p90_ms": float(np.percentile(vs, 90)),
            "turns": len(vs),
        }
        for name, vs in ms.items()
    }
    fig["remote_ttfa_overhead_ms_p50"] = fig["remote"]["p50_ms"] - fig["local"]["p50_ms"]
    fig["machine"] = f"{platform.machine()}, {os.cpu_count()} cores"
    fig["stages"] = "test stages; remote = LLM on a second duplex-server over loopback HTTP"
    print(f"\nTTFA of a voice turn (speech_stopped -> first audio), {args.turns} turns each")
    print(f"{'LLM':8} | {'p50 ms':>7} | {'p90 ms':>7}")
    for name in ("local", "remote"):
        print(f"{name:8} | {fig[name]['p50_ms']:7.1f} | {fig[name]['p90_ms']:7.1f}")
    print(f"remote_ttfa_overhead_ms_p50 = {fig['remote_ttfa_overhead_ms_p50']:.1f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(fig, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
