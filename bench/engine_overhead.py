"""Engine overhead: per-chunk routing cost, cancel latency and stale chunks after a cancel.

Uses the deterministic test stage at real-time pace (100 ms audio chunks emitted every
100 ms), so what is measured is the engine itself: orchestrator, queues, routing.

    python bench/engine_overhead.py [--sessions 1 32 256] [--quick] [--json PATH]

(a) chunk overhead: stage output (AudioOut.t_ns) -> the chunk leaving session_events()
(b) cancel: signal(barge_in) sent -> ResponseDone{cancelled} received on the session stream
(c) stale chunks: audio of the cancelled fence delivered after that ResponseDone (must be 0)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

from duplex_contract.control import AppendCall, CloseCall, CommitCall, OpenCall, SignalCall
from duplex_contract.fence import Fence
from duplex_contract.session_events import AudioChunk, ResponseDone
from duplex_contract.settings import SessionSettings
from engine.api.client import AsyncEngine
from engine.config import load_engine_config
from engine.stages.testing import TestStage, TestStageOptions

ROOT = Path(__file__).resolve().parents[1]


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))
    return values[k]


async def one_session(
    engine: AsyncEngine,
    chunks_before_cancel: int,
    linger_s: float,
    overhead: list[float],
    cancels: list[float],
    stale: list[int],
) -> None:
    res = await engine.call(OpenCall(config=SessionSettings(output_modalities=("audio",))))
    assert res.session_id and res.accepted_fence
    sid, gen = res.session_id, res.lease_generation
    await engine.call(AppendCall(fence=res.accepted_fence, lease_generation=gen, text="hello"))
    fence = (
        await engine.call(CommitCall(fence=res.accepted_fence, lease_generation=gen))
    ).accepted_fence
    assert fence is not None
    events = engine.session_events(sid)
    seen = 0
    async for ev in events:
        if isinstance(ev, AudioChunk):
            overhead.append((time.monotonic_ns() - ev.t_stage_ns) / 1e6)
            seen += 1
            if seen == chunks_before_cancel:
                break
    t0 = time.perf_counter()
    nxt = Fence(sid, fence.epoch + 1, fence.turn_id, fence.response_seq)
    await engine.call(
        SignalCall(fence=fence, lease_generation=gen, event="barge_in", next_fence=nxt)
    )
    late = 0
    async for ev in events:
        if isinstance(ev, AudioChunk):
            late += 1  # an old-epoch chunk before the done: allowed, but counted as overhead
            overhead.append((time.monotonic_ns() - ev.t_stage_ns) / 1e6)
        if isinstance(ev, ResponseDone):
            cancels.append((time.perf_counter() - t0) * 1000)
            break
    after = 0

    async def linger() -> None:
        nonlocal after
        async for ev in events:
            if isinstance(ev, AudioChunk) and ev.fence.epoch == fence.epoch:
                after += 1

    try:
        await asyncio.wait_for(linger(), linger_s)
    except TimeoutError:
        pass
    stale.append(after)
    await engine.call(CloseCall(fence=nxt, lease_generation=gen))


async def run_level(n: int, chunks: int, linger_s: float) -> dict[str, float | int]:
    cfg = load_engine_config(ROOT / "configs" / "test.yaml")
    opts = TestStageOptions(
        realtime=True, chunk_ms=100.0, token_interval_s=0.005, reply="word " * 200
    )
    backends = {k: [TestStage(opts, k)] for k in ("asr", "llm", "tts")}
    engine = await AsyncEngine.start(cfg, backends)  # type: ignore[arg-type]
    overhead: list[float] = []
    cancels: list[float] = []
    stale: list[int] = []
    try:
        await asyncio.gather(
            *(one_session(engine, chunks, linger_s, overhead, cancels, stale) for _ in range(n))
        )
        dropped = engine.stats().stale_chunks_dropped
    finally:
        await engine.shutdown()
    return {
        "sessions": n,
        "chunks": len(overhead),
        "chunk_overhead_ms_p50": round(pct(overhead, 50), 4),
        "chunk_overhead_ms_p99": round(pct(overhead, 99), 4),
        "cancel_ms_p50": round(pct(cancels, 50), 3),
        "cancel_ms_p99": round(pct(cancels, 99), 3),
        "stale_chunks_after_cancel": sum(stale),
        "stale_dropped_in_engine": dropped,
        "mean_overhead_ms": round(statistics.fmean(overhead), 4) if overhead else float("nan"),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, nargs="+", default=[1, 32, 256])
    ap.add_argument("--quick", action="store_true", help="fewer chunks per session")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    chunks = 5 if args.quick else 20
    linger = 0.3 if args.quick else 1.0
    rows = [asyncio.run(run_level(n, chunks, linger)) for n in args.sessions]
    cols = [
        "sessions",
        "chunks",
        "chunk_overhead_ms_p50",
        "chunk_overhead_ms_p99",
        "cancel_ms_p50",
        "cancel_ms_p99",
        "stale_chunks_after_cancel",
    ]
    print(" | ".join(f"{c:>24}" for c in cols))
    for r in rows:
        print(" | ".join(f"{r[c]!s:>24}" for c in cols))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"results": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
