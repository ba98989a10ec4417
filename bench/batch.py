"""Batch path benchmark: batch throughput alone, and session TTFA with and without a
concurrent batch burst, side by side (sessions must keep priority).

    .venv/bin/python bench/batch.py [--real] [--turns 10] [--burst 8] [--json PATH]

The real server runs in-process under uvicorn on 127.0.0.1:0 with configs/test.yaml (the
deterministic test stage) or, with ``--real``, configs/cpu.yaml (the embedded CPU models).
TTFA here = ``response.create`` sent -> first ``response.output_audio.delta`` received, on a
text turn (so ASR and VAD are out of the measurement and only scheduling differs).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import uvicorn

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "clients")]

from duplex_client import DuplexClient  # noqa: E402
from duplex_client import events as ev  # noqa: E402

from duplex_contract.audible import AudibleStart  # noqa: E402
from duplex_server.app import create_app  # noqa: E402
from duplex_server.config import load_app_config  # noqa: E402

SPEECH = "The quick brown fox jumps over the lazy dog, and then it runs away into the woods."


@contextmanager
def serve(config_path: Path) -> Iterator[str]:
    app = create_app(load_app_config(config_path))
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", ws="websockets-sansio")
    )
    thread = threading.Thread(target=server.run, name="bench-server", daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.02)
        addr = f"127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
        deadline = time.monotonic() + 600
        while httpx.get(f"http://{addr}/health").status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError("engine did not become ready")
            time.sleep(0.2)
        yield addr
    finally:
        server.should_exit = True
        thread.join(60)


async def speech_request(http: httpx.AsyncClient, addr: str) -> tuple[float, float]:
    """(latency s, audio s) of one batch speech request (pcm)."""
    start = time.monotonic()
    body = {"model": "duplex", "input": SPEECH, "response_format": "pcm"}
    resp = await http.post(f"http://{addr}/v1/audio/speech", json=body, timeout=300)
    resp.raise_for_status()
    return time.monotonic() - start, len(resp.content) / 48000


async def batch_alone(addr: str, requests: int, concurrency: int) -> dict[str, float]:
    sem = asyncio.Semaphore(concurrency)

    async def one(http: httpx.AsyncClient) -> tuple[float, float]:
        async with sem:
            return await speech_request(http, addr)

    async with httpx.AsyncClient() as http:
        start = time.monotonic()
        results = await asyncio.gather(*(one(http) for _ in range(requests)))
        wall = time.monotonic() - start
    lat = sorted(r[0] for r in results)
    return {
        "batch_requests_per_s": requests / wall,
        "batch_audio_s_per_s": sum(r[1] for r in results) / wall,
        "batch_latency_p50_ms": statistics.median(lat) * 1000,
    }


async def session_ttfa(addr: str, turns: int, audible: list[float] | None = None) -> list[float]:
    """Each turn's first audio byte (ms after response.create); ``audible`` gets its first
    audible sample (duplex_contract.audible.AudibleStart: -40 dBFS, as a player reaches it)."""
    out: list[float] = []
    async with await DuplexClient.connect(f"ws://{addr}/v1/realtime") as client:
        await client.update_session({"audio": {"input": {"turn_detection": None}}})
        while not isinstance(await client.next_event(30), ev.SessionUpdated):
            pass
        for _ in range(turns):
            await client.send_text("Tell me about the weather.", respond=False)
            start = time.monotonic()
            await client.create_response()
            first: float | None = None
            heard = AudibleStart()
            while True:
                event = await client.next_event(300)
                if isinstance(event, ev.AudioDelta):
                    now = time.monotonic()
                    if first is None:
                        first = now - start
                    heard.feed(now, base64.b64decode(event.delta), 24000)
                if isinstance(event, ev.ResponseDone):
                    break
            if first is not None:
                out.append(first * 1000)
            if audible is not None and heard.at is not None:
                audible.append((heard.at - start) * 1000)
    return out


async def with_burst(addr: str, turns: int, burst: int) -> tuple[list[float], int]:
    stop = asyncio.Event()
    done = 0

    async def hammer(http: httpx.AsyncClient) -> None:
        nonlocal done
        while not stop.is_set():
            await speech_request(http, addr)
            done += 1

    async with httpx.AsyncClient() as http:
        tasks = [asyncio.create_task(hammer(http)) for _ in range(burst)]
        await asyncio.sleep(0.5)  # the burst is running before the first turn
        try:
            ttfa = await session_ttfa(addr, turns)
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
    return ttfa, done


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


async def run(addr: str, args: argparse.Namespace) -> dict[str, float]:
    results = await batch_alone(addr, args.requests, args.burst)
    audible: list[float] = []
    quiet = await session_ttfa(addr, args.turns, audible)
    busy, during = await with_burst(addr, args.turns, args.burst)
    results |= {
        "ttfa_alone_p50_ms": pct(quiet, 0.5),
        "audible_alone_p50_ms": pct(audible, 0.5) if audible else float("nan"),
        "ttfa_alone_p90_ms": pct(quiet, 0.9),
        "ttfa_burst_p50_ms": pct(busy, 0.5),
        "ttfa_burst_p90_ms": pct(busy, 0.9),
        "ttfa_burst_delta_p50_ms": pct(busy, 0.5) - pct(quiet, 0.5),
        "batch_requests_during_turns": float(during),
    }
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--real", action="store_true", help="configs/cpu.yaml (real models)")
    parser.add_argument("--config", type=Path, help="another config file")
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--burst", type=int, default=8, help="concurrent batch requests")
    parser.add_argument("--requests", type=int, default=32, help="batch requests, alone")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    config = args.config or ROOT / "configs" / ("cpu.yaml" if args.real else "test.yaml")
    with serve(config) as addr:
        results = asyncio.run(run(addr, args))
    print(f"config: {config.relative_to(ROOT) if config.is_relative_to(ROOT) else config}")
    print(f"{'metric':32} {'value':>10}")
    for key, value in results.items():
        print(f"{key:32} {value:10.1f}")
    print(
        f"\nsession TTFA p50: alone {results['ttfa_alone_p50_ms']:.0f} ms"
        f" (first audible {results['audible_alone_p50_ms']:.0f} ms) | "
        f"with {args.burst} concurrent batch requests {results['ttfa_burst_p50_ms']:.0f} ms"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"config": str(config), **results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
