"""Batched Whisper ASR vs one-at-a-time, in the same run, on the batching stage runtime.

    python bench/stage_batching.py [--json PATH] [--rounds N] [--threads T]

N concurrent utterances (N = 1, 4, 8; six real human phrases cut from tests/data/beckett.wav,
reused in turn) are submitted together to one Whisper replica, as N sessions would at the
same moment. *batched*: the replica's ``max_batch`` is 8, so the runtime transcribes what is
ready in one call; *serial*: ``max_batch`` 1, one utterance at a time (the old runtime).
Latency is submit -> transcript of each utterance; throughput is N / wall time of the round.
Both modes use the same loaded model, in alternating rounds. The transcripts of both modes
are compared (they should be identical: greedy decoding of the same windows).

JSON keys: ``asr_batch_speedup_at_8`` (throughput ratio batched/serial at 8),
``asr_batched_p99_ms_at_8``, ``asr_serial_p99_ms_at_8``, and per-N figures under ``by_n``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import soundfile as sf

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from duplex_contract.batch import TranscriptOut
from engine.messages import AsrRequest
from engine.stages.asr_whisper import WhisperAsr, WhisperOptions

BECKETT = Path(__file__).resolve().parent.parent / "tests" / "data" / "beckett.wav"
# the six phrases Silero finds in beckett.wav (tests/data/README.md), with 150 ms margins
PHRASES_S = [(0.35, 1.22), (1.89, 2.82), (3.52, 4.19), (4.90, 5.60), (6.66, 7.39), (8.16, 8.90)]


def phrases() -> list[bytes]:
    audio, rate = sf.read(BECKETT, dtype="int16")
    assert rate == 16000
    out = []
    for a, b in PHRASES_S:
        lo, hi = max(0, int((a - 0.15) * rate)), int((b + 0.15) * rate)
        out.append(np.ascontiguousarray(audio[lo:hi]).tobytes())
    return out


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.array(values), q))


async def one_round(
    asr: WhisperAsr, clips: list[bytes], n: int, tag: str
) -> tuple[float, list[float], list[str]]:
    async def one(i: int) -> tuple[float, str]:
        req = AsrRequest(
            request_id=f"{tag}-s{i}/asr/t0/0", audio=clips[i % len(clips)], session_id=f"s{i}"
        )
        start = time.perf_counter()
        text = ""
        async for out in asr.submit(req):
            if isinstance(out, TranscriptOut):
                text = out.text
        return time.perf_counter() - start, text

    start = time.perf_counter()
    results = await asyncio.gather(*(one(i) for i in range(n)))
    wall = time.perf_counter() - start
    return wall, [r[0] for r in results], [r[1] for r in results]


async def bench(rounds: int, threads: int) -> dict[str, Any]:
    clips = phrases()
    asr = WhisperAsr(WhisperOptions(max_batch=8, cpu_threads=threads), "asr")
    load_start = time.perf_counter()
    await asr.start()
    load_s = time.perf_counter() - load_start
    by_n: dict[str, Any] = {}
    mismatches = 0
    try:
        await one_round(asr, clips, 2, "warm")
        for n in (1, 4, 8):
            figures: dict[str, dict[str, list[float]]] = {
                "batched": {"lat": [], "wall": []},
                "serial": {"lat": [], "wall": []},
            }
            texts: dict[str, list[str]] = {}
            for r in range(rounds):
                for mode in ("batched", "serial") if r % 2 == 0 else ("serial", "batched"):
                    asr.runtime.max_batch = 8 if mode == "batched" else 1
                    wall, lats, out = await one_round(asr, clips, n, f"{mode}{r}")
                    figures[mode]["lat"].extend(lats)
                    figures[mode]["wall"].append(wall)
                    texts.setdefault(mode, out)
            mismatches += sum(
                a != b for a, b in zip(texts["batched"], texts["serial"], strict=True)
            )
            row: dict[str, Any] = {}
            for mode, f in figures.items():
                row[mode] = {
                    "throughput_per_s": n * len(f["wall"]) / sum(f["wall"]),
                    "p50_ms": pct(f["lat"], 50) * 1000,
                    "p99_ms": pct(f["lat"], 99) * 1000,
                }
            row["speedup"] = row["batched"]["throughput_per_s"] / row["serial"]["throughput_per_s"]
            row["texts"] = texts["batched"][: len(clips)]
            by_n[str(n)] = row
    finally:
        await asr.close()
    eight = by_n["8"]
    return {
        "asr_batch_speedup_at_8": eight["speedup"],
        "asr_batched_p99_ms_at_8": eight["batched"]["p99_ms"],
        "asr_serial_p99_ms_at_8": eight["serial"]["p99_ms"],
        "transcript_mismatches": mismatches,
        "by_n": by_n,
        "rounds": rounds,
        "cpu_threads": threads,
        "load_s": load_s,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.processor() or ''}",
        "model": "Whisper-base int8 (faster-whisper / CTranslate2), greedy",
    }


def print_table(f: dict[str, Any]) -> None:
    print(f"\nWhisper ASR on the batching runtime ({f['machine']}; {f['rounds']} rounds)")
    print(f"{'N':>3} | {'mode':8} | {'utt/s':>6} | {'p50 ms':>7} | {'p99 ms':>7} | speedup")
    print("----+----------+--------+---------+---------+--------")
    for n, row in f["by_n"].items():
        for mode in ("serial", "batched"):
            r = row[mode]
            extra = f"{row['speedup']:.2f}x" if mode == "batched" else ""
            print(
                f"{n:>3} | {mode:8} | {r['throughput_per_s']:6.2f} | {r['p50_ms']:7.0f} | "
                f"{r['p99_ms']:7.0f} | {extra}"
            )
    print(f"transcript mismatches batched vs serial: {f['transcript_mismatches']}")
    print(f"asr_batch_speedup_at_8 = {f['asr_batch_speedup_at_8']:.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, help="write the figures here as JSON")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per mode and N")
    parser.add_argument("--threads", type=int, default=2, help="CTranslate2 intra-op threads")
    args = parser.parse_args(argv)
    figures = asyncio.run(bench(args.rounds, args.threads))
    print_table(figures)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
