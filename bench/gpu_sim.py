"""The session ladder on a simulated GPU (configs/sim-h200.yaml): commit -> first audio and
playback underruns at 16..128 concurrent spoken sessions, per scheduling policy.

Starts the real server (``duplex-server serve``) on the sim config with the policy asked for
(``--policy serial``: today's CPU gates; ``capacity``: engine/orchestration/scheduling.py), then,
for each step of the ladder, N real WebSocket clients on one asyncio loop in this process. Each
session speaks a short turn every 8-12 s (1 s of a 300 Hz tone, then 0.8 s of silence, in
real-time 20 ms binary PCM frames; the server's energy VAD ends the turn) and listens to the
whole answer before its next turn. Measured at the client:

* ``ttfa`` = ``input_audio_buffer.committed`` received -> first
  ``response.output_audio.delta`` received (the issue's "commit -> first audio"; the commit
  is the server VAD's, ~0.5 s after the last voiced frame);
* ``underruns``: the client plays each answer in real time from its first chunk; an
  underrun is a chunk that arrives after the audio buffered before it has run out (10 ms
  of slack for this client's own scheduling jitter).

From the server's ``/metrics`` (deltas over the step): ``duplex_stage_batch_size`` (requests
per call or step of each stage) and ``duplex_stage_queue_wait_seconds`` (a request's wait in
its stage's queue). Each step also records the server's CPU use and the load average: this
machine runs the server and every client, so a step can be bound by its CPU rather than by
the simulated GPU (``server_cpu_pct`` near 100 x cores says so).

Every figure is "simulated GPU timings" (engine/stages/sim.py's cost model), not a GPU's.

Usage: ``python bench/gpu_sim.py [--json PATH] [--policy serial|capacity]
[--steps 16,32,64,96,128] [--step-s 45] [--runs 3]``; ``--plot A.json B.json [--png PATH]``
draws the ladders' p95 vs sessions (docs/figures/gpu-sim-ladder.png). The ladder runs
``--runs`` times (a fresh server each), and each step's figures are the median of the runs.
Prints a table, the load average and a machine probe (``probe_ms``: a fixed pure-Python
workload; machines of one kind differ up to 2x). JSON: ``sim_sessions_p95_500ms`` (the
largest step whose median p95 ttfa is <= 500 ms with 0 underruns in every run), ``steps``
(per step the medians of ``ttfa_ms_p50``, ``ttfa_ms_p95``, ``underruns`` (and their
``underruns_max``), ``batch_size_p50`` and ``queue_wait_ms_p95`` per stage) and ``runs``
(every run's rows).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import websockets
import yaml
from realtime import cpu_seconds, quantile
from serverproc import ROOT, running_server

RATE = 24000  # the session's default input and output rate (pcm16)
FRAME = RATE // 50 * 2  # 20 ms of PCM16
STAGES = ("asr", "llm", "talker", "codec")
SLACK_S = 0.010
HISTS = ("duplex_stage_batch_size", "duplex_stage_queue_wait_seconds")


def frames(pcm: bytes) -> list[bytes]:
    return [pcm[i : i + FRAME] for i in range(0, len(pcm), FRAME)]


def turn_frames() -> list[bytes]:
    t = np.arange(RATE) / RATE  # 1 s voiced
    voiced = (np.sin(2 * np.pi * 300.0 * t) * 0.3 * 32767).astype("<i2").tobytes()
    return frames(voiced + b"\0\0" * int(RATE * 0.8))


@dataclass
class Figures:
    ttfa_s: list[float] = field(default_factory=list)
    ttfa_voice_s: list[float] = field(default_factory=list)  # from the last voiced frame
    underruns: int = 0
    late_s: list[float] = field(default_factory=list)  # how late each underrun's chunk was
    answers: int = 0
    failed: list[str] = field(default_factory=list)


def audio_s(delta_b64: str) -> float:
    n = len(delta_b64) * 3 // 4 - delta_b64[-2:].count("=")
    return n / 2 / RATE


async def session(addr: str, pcm: list[bytes], until: float, fig: Figures, seed: int) -> None:
    rng = random.Random(seed)
    async with websockets.connect(f"ws://{addr}/v1/realtime", max_size=None) as ws:
        while json.loads(await ws.recv())["type"] != "session.created":
            pass
        await asyncio.sleep(rng.uniform(0.0, 10.0))  # spread the sessions' turns
        while time.monotonic() < until:
            start = time.monotonic()
            t0 = start
            voiced_end = 0.0
            for i, frame in enumerate(pcm):
                await ws.send(frame)
                if i == RATE // (FRAME // 2) - 1:
                    voiced_end = time.monotonic()
                await asyncio.sleep(max(0.0, t0 + (i + 1) * 0.02 - time.monotonic()))
            committed = first = played_until = 0.0
            got_audio = False
            while True:
                ev = json.loads(await asyncio.wait_for(ws.recv(), 30.0))
                kind = ev["type"]
                now = time.monotonic()
                if kind == "input_audio_buffer.committed" and not committed:
                    committed = now
                elif kind == "response.output_audio.delta":
                    dur = audio_s(ev["delta"])
                    if not got_audio:
                        got_audio, first = True, now
                        if committed:
                            fig.ttfa_s.append(first - committed)
                        fig.ttfa_voice_s.append(first - voiced_end)
                        played_until = now + dur
                    else:
                        if now > played_until + SLACK_S:
                            fig.underruns += 1
                            fig.late_s.append(now - played_until)
                        played_until = max(played_until, now) + dur
                elif kind == "response.done":
                    status = ev["response"]["status"]
                    if status != "completed":
                        fig.failed.append(f"{status}: {ev['response'].get('status_details')}")
                    fig.answers += 1
                    break
            await asyncio.sleep(max(0.0, played_until - time.monotonic()))  # hear it out
            await asyncio.sleep(max(0.0, start + rng.uniform(8.0, 12.0) - time.monotonic()))


def scrape(addr: str) -> dict[tuple[str, str], dict[float, float]]:
    """Cumulative buckets of the per-stage histograms: (histogram, stage) -> {le: count}."""
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[tuple[str, str], dict[float, float]] = {}
    for line in text.splitlines():
        for name in HISTS:
            if line.startswith(f"{name}_bucket{{"):
                stage = line.split('stage="')[1].split('"')[0]
                le = line.split('le="')[1].split('"')[0]
                key = float("inf") if le == "+Inf" else float(le)
                out.setdefault((name, stage), {})[key] = float(line.rsplit(" ", 1)[1])
    return out


def bucket_quantile(before: dict[float, float], after: dict[float, float], q: float) -> float:
    """The smallest bucket bound holding the ``q`` quantile (batch sizes are whole numbers
    and the buckets powers of two: "at most this many")."""
    bounds = sorted(after)
    total = after[bounds[-1]] - before.get(bounds[-1], 0.0) if bounds else 0.0
    if total <= 0:
        return float("nan")
    for b in bounds:
        if after[b] - before.get(b, 0.0) >= q * total:
            return b
    return bounds[-1]


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    return float(np.percentile(np.asarray(xs), q))


def _num(x: float) -> float | None:
    return None if math.isnan(x) else round(x, 2)


async def step(addr: str, pid: int, n: int, seconds: float) -> dict[str, Any]:
    pcm = turn_frames()
    fig = Figures()
    before = await asyncio.to_thread(scrape, addr)
    cpu0, t0 = cpu_seconds(pid), time.monotonic()
    until = t0 + seconds
    tasks = [asyncio.create_task(session(addr, pcm, until, fig, i)) for i in range(n)]
    results = await asyncio.gather(*tasks, return_exceptions=True)
    wall = time.monotonic() - t0
    cpu = cpu_seconds(pid) - cpu0
    after = await asyncio.to_thread(scrape, addr)
    errors = [repr(r) for r in results if isinstance(r, BaseException)]
    row: dict[str, Any] = {
        "sessions": n,
        "turns": fig.answers,
        "ttfa_ms_p50": _ms(pct(fig.ttfa_s, 50)),
        "ttfa_ms_p95": _ms(pct(fig.ttfa_s, 95)),
        "ttfa_from_voice_ms_p95": _ms(pct(fig.ttfa_voice_s, 95)),
        "underruns": fig.underruns,
        "underrun_late_ms_p50": _ms(pct(fig.late_s, 50)),
        "underrun_late_ms_max": _ms(max(fig.late_s, default=None)),
        "failed_responses": len(fig.failed),
        "client_errors": len(errors),
        "batch_size_p50": {},
        "queue_wait_ms_p95": {},
        "server_cpu_pct": round(100 * cpu / wall, 1),
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }
    for stage in STAGES:
        key = ("duplex_stage_batch_size", stage)
        if key in after:
            p50 = bucket_quantile(before.get(key, {}), after[key], 0.5)
            row["batch_size_p50"][stage] = _num(p50)
        key = ("duplex_stage_queue_wait_seconds", stage)
        if key in after:
            q = quantile(before.get(key, {}), after[key], 0.95)
            row["queue_wait_ms_p95"][stage] = None if math.isnan(q) else round(q * 1000, 1)
    if errors or fig.failed:
        row["first_errors"] = (errors + fig.failed)[:3]
    return row


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1000, 1)


def config_for(policy: str, tmp: Path) -> Path:
    raw = yaml.safe_load((ROOT / "configs" / "sim-h200.yaml").read_text())
    raw["engine"]["scheduling"]["policy"] = policy
    path = tmp / f"sim-{policy}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


async def ladder(addr: str, pid: int, steps: list[int], seconds: float) -> list[dict[str, Any]]:
    rows = []
    for n in steps:
        row = await step(addr, pid, n, seconds)
        rows.append(row)
        print(json.dumps(row), flush=True)
        await asyncio.sleep(2.0)  # the sessions close; the stages drain
    return rows


def best(rows: list[dict[str, Any]]) -> int:
    ok = [
        r["sessions"]
        for r in rows
        if r["ttfa_ms_p95"] is not None
        and r["ttfa_ms_p95"] <= 500
        and r.get("underruns_max", r["underruns"]) == 0
        and not r["client_errors"]
        and not r["failed_responses"]
    ]
    return max(ok, default=0)


def probe_ms() -> float:
    """A fixed pure-Python workload (ms): how fast this machine's cores are right now."""
    t = time.perf_counter()
    acc = 0.0
    for i in range(1_000_000):
        acc += math.sqrt(i)
    return round((time.perf_counter() - t) * 1000, 1)


def _median(xs: list[Any]) -> Any:
    vals = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return statistics.median(vals) if vals else None


def merge_runs(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each step's median over the runs (underruns also as their maximum)."""
    rows = []
    for i, first in enumerate(runs[0]):
        same = [run[i] for run in runs]
        row: dict[str, Any] = {"sessions": first["sessions"]}
        for key in (
            "turns",
            "ttfa_ms_p50",
            "ttfa_ms_p95",
            "ttfa_from_voice_ms_p95",
            "underruns",
            "failed_responses",
            "client_errors",
            "server_cpu_pct",
            "loadavg_1m",
        ):
            row[key] = _median([r[key] for r in same])
        row["underruns_max"] = max(r["underruns"] for r in same)
        row["client_errors"] = max(r["client_errors"] for r in same)
        row["failed_responses"] = max(r["failed_responses"] for r in same)
        for key in ("batch_size_p50", "queue_wait_ms_p95"):
            row[key] = {st: _median([r[key].get(st) for r in same]) for st in first[key]}
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| sessions | turns | p50 ms | p95 ms | underruns (max) | batch p50 asr/llm/talker/codec"
        " | queue wait p95 ms asr/llm/talker/codec | server CPU % | load 1m |"
    )
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        batch = "/".join(str(r["batch_size_p50"].get(st)) for st in STAGES)
        wait = "/".join(str(r["queue_wait_ms_p95"].get(st)) for st in STAGES)
        lines.append(
            f"| {r['sessions']} | {r['turns']} | {r['ttfa_ms_p50']} | {r['ttfa_ms_p95']} | "
            f"{r['underruns']} ({r.get('underruns_max', r['underruns'])}) | {batch} | {wait} | "
            f"{r['server_cpu_pct']} | {r['loadavg_1m']} |"
        )
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """p95 commit -> first audio vs sessions, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for res in results:
        rows = [r for r in res["steps"] if r["ttfa_ms_p95"] is not None]
        xs = [r["sessions"] for r in rows]
        ax.plot(xs, [r["ttfa_ms_p95"] for r in rows], marker="o", label=f"{res['policy']} p95")
        ax.plot(
            xs, [r["ttfa_ms_p50"] for r in rows], ls=":", marker=".", label=f"{res['policy']} p50"
        )
        for r in rows:
            if r["underruns"]:
                ax.annotate(f"{r['underruns']} underruns", (r["sessions"], r["ttfa_ms_p95"]))
    ax.axhline(500, color="r", ls="--", lw=1, label="500 ms goal")
    ax.set_xlabel("concurrent spoken sessions")
    ax.set_ylabel("commit -> first audio (ms)")
    runs = {len(res.get("runs", [])) or 1 for res in results}
    each = f"median of {runs.pop()} runs" if len(runs) == 1 else "medians"
    ax.set_title(f"simulated GPU timings (configs/sim-h200.yaml), {each} per step", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--policy", choices=["serial", "capacity"], default="capacity")
    ap.add_argument("--steps", default="16,32,64,96,128")
    ap.add_argument("--step-s", type=float, default=45.0)
    ap.add_argument("--runs", type=int, default=3, help="ladders to run (median per step)")
    ap.add_argument(
        "--plot",
        nargs="+",
        type=Path,
        metavar="JSON",
        help="plot these results (files written by --json) to --png instead of running",
    )
    ap.add_argument("--png", type=Path, default=ROOT / "docs" / "figures" / "gpu-sim-ladder.png")
    args = ap.parse_args()
    if args.plot:
        plot([json.loads(p.read_text()) for p in args.plot], args.png)
        return 0
    steps = [int(s) for s in args.steps.split(",")]
    load0, probe0 = [round(x, 2) for x in os.getloadavg()], probe_ms()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        cfg = config_for(args.policy, Path(tmp))
        for _ in range(args.runs):
            with running_server(cfg, quiet=True) as (addr, pid):
                runs.append(asyncio.run(ladder(addr, pid, steps, args.step_s)))
    rows = merge_runs(runs)
    out = {
        "label": "simulated GPU timings (configs/sim-h200.yaml cost model), not a GPU",
        "policy": args.policy,
        "machine_cpus": os.cpu_count(),
        "loadavg_start": load0,
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "probe_ms": [probe0, probe_ms()],
        "sim_sessions_p95_500ms": best(rows),
        "sim_sessions_p95_500ms_per_run": [best(run) for run in runs],
        "steps": rows,
        "runs": runs,
    }
    print(f"policy {args.policy}, {args.runs} run(s), median per step (simulated GPU timings):")
    print(table(rows))
    print(f"load average at start {load0}, end {out['loadavg_end']}; probe {out['probe_ms']} ms")
    print(json.dumps({k: v for k, v in out.items() if k not in ("steps", "runs")}))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
