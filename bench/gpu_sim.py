"""The session ladder on a simulated GPU: commit -> first audio, playback underruns and batch
speech at a rising number of concurrent spoken sessions.

Two ladders, one script:

* **A config users deploy, on one simulated device** (the issue-38 figure):
  ``--config configs/gpu-talker.yaml --simulate configs/sim-h200.yaml`` swaps each stage's
  backend for ``sim`` (engine/stages/sim_costs.py ``simulate_config``), keeping the config's
  routes, devices (all four stages on ``cuda:0``: one device whose time they share),
  scheduling, windows and caps; the costs come from the cost file the sim config names
  (configs/sim/h200-costs.yaml). Its pass figure is ``sim_sessions_one_gpu`` (when every stage
  shares one device; ``sim_sessions_<n>_devices`` otherwise).
* **The four-device simulation** (``--config`` left out: configs/sim-h200.yaml, a device per
  stage, an upper bound), with ``--policy serial|capacity`` to compare the scheduling
  policies; ``sim_sessions_p95_500ms`` stays its figure.

The server's VAD is the energy VAD in both (this machine runs every client too; the
deployment's VAD is not what is measured), and the turn detector is ``server_vad`` with its
500 ms window. The workload (bench/sim_workload.py): speech-like turns of one or two
phrases, ``--wrong-guess-pct`` of them with a pause inside that the engine guesses on
wrongly, ``--bargein-pct`` of the answers interrupted, batch speech at ``--batch-rps``.

A step passes, in each run, when p95 commit -> first audio <= 500 ms, there is no underrun,
no response or client failed, and every batch request was answered (first audio p95 <=
1.5 s). Per step (the median of the runs; JSON ``steps``, every run in ``runs``):
``ttfa_ms_p50``/``_p95``, ``ttfa_from_voice_ms_p95`` (last voiced frame -> first audio),
``underruns`` (and ``underruns_max``), ``wrong_guesses`` (pause guesses the commit did not
use), ``drafts_dropped``, ``bargeins``, ``draft_work_wasted_pct`` per stage (outputs of drafts
thrown away, of all the stage's outputs), ``batch_first_audio_ms_p95``, ``batch_failed``,
``wait_max_ms`` per stage (the longest wait of a request in the stage's queue, histogram
bound) and ``batch_wait_max_ms`` (to be admitted by the scheduler), batch size p50 and
queue wait p95 per stage, the server's CPU and the load average.

Usage: ``python bench/gpu_sim.py [--config PATH --simulate COSTS] [--policy P] [--steps
16,24,32,48,64] [--step-s 60] [--runs 3] [--json PATH]``; ``--quick`` (16,32 for 20 s, one
run) for development; ``--host-cpu`` adds the cost file's host CPU per item (burned for real
in the server: on a small machine that also runs every client it measures the machine, so
it is its own ladder); ``--plot A.json B.json [--png PATH]`` draws ladders' p95 vs sessions.
Prints a table, the load average and a machine probe (bench/probe.py). Every figure is
"simulated GPU timings" (the cost model), not a GPU's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from probe import probe_ms
from realtime import cpu_seconds, quantile
from serverproc import ROOT, running_server
from sim_workload import Figures, batch_speech, session

from engine.stages.sim_costs import cost_file_of, load_costs, simulate_config

STAGES = ("asr", "llm", "talker", "codec")
HISTS = (
    "duplex_stage_batch_size",
    "duplex_stage_queue_wait_seconds",
    "duplex_scheduler_batch_wait_seconds",
)
COUNTERS = (
    "duplex_speculative_transcripts",
    "duplex_speculative_responses",
    "duplex_stage_outputs",
    "duplex_stage_busy_seconds",
)
TTFA_MS, BATCH_FIRST_MS = 500.0, 1500.0


# ----------------------------------------------------------------------------- /metrics
def scrape(addr: str) -> dict[str, Any]:
    """Cumulative figures: histogram buckets (name, stage) -> {le: count}, and counters
    (name, labels) -> value."""
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as r:
        text = r.read().decode()
    hists: dict[tuple[str, str], dict[float, float]] = {}
    counts: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        for name in HISTS:
            if line.startswith(f"{name}_bucket{{"):
                stage = line.split('stage="')[1].split('"')[0]
                le = line.split('le="')[1].split('"')[0]
                key = float("inf") if le == "+Inf" else float(le)
                hists.setdefault((name, stage), {})[key] = float(line.rsplit(" ", 1)[1])
        for name in COUNTERS:
            if line.startswith((f"{name}_total{{", f"{name}{{")):
                labels = line[line.index("{") + 1 : line.index("}")]
                counts[(name, labels)] = float(line.rsplit(" ", 1)[1])
    return {"hists": hists, "counts": counts}


def delta(before: dict[str, Any], after: dict[str, Any], name: str, labels: str) -> float:
    key = (name, labels)
    return after["counts"].get(key, 0.0) - before["counts"].get(key, 0.0)


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


def top_bucket_ms(before: dict[float, float], after: dict[float, float]) -> float | None:
    """The bound (ms) of the highest bucket any observation of the interval reached: the
    longest wait, "at most this" (the last finite bound + 1 past it)."""
    bounds = sorted(after)
    top = None
    prev = 0.0
    for b in bounds:
        n = after[b] - before.get(b, 0.0)
        if n > prev:
            top = b
        prev = n
    if top is None:
        return None
    if top == float("inf"):
        finite = [b for b in bounds if b != float("inf")]
        return round(finite[-1] * 1000 + 1, 1) if finite else None
    return round(top * 1000, 1)


def pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(xs), q)) if xs else None


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1000, 1)


def _num(x: float) -> float | None:
    return None if math.isnan(x) else round(x, 2)


# ----------------------------------------------------------------------------- one step
async def step(
    addr: str, pid: int, n: int, seconds: float, args: argparse.Namespace
) -> dict[str, Any]:
    fig = Figures()
    before = await asyncio.to_thread(scrape, addr)
    cpu0, t0 = cpu_seconds(pid), time.monotonic()
    until = t0 + seconds
    tasks = [
        asyncio.create_task(
            session(addr, until, fig, 1000 * n + i, args.wrong_guess_pct, args.bargein_pct)
        )
        for i in range(n)
    ]
    batch = asyncio.create_task(batch_speech(addr, until, args.batch_rps, fig, n))
    results = await asyncio.gather(*tasks, batch, return_exceptions=True)
    wall = time.monotonic() - t0
    cpu = cpu_seconds(pid) - cpu0
    after = await asyncio.to_thread(scrape, addr)
    errors = [repr(r) for r in results if isinstance(r, BaseException)]
    guesses = delta(before, after, "duplex_speculative_transcripts", 'outcome="started"')
    used = delta(before, after, "duplex_speculative_transcripts", 'outcome="used"')
    row: dict[str, Any] = {
        "sessions": n,
        "turns": fig.answers,
        "ttfa_ms_p50": _ms(pct(fig.ttfa_s, 50)),
        "ttfa_ms_p95": _ms(pct(fig.ttfa_s, 95)),
        "ttfa_from_voice_ms_p95": _ms(pct(fig.ttfa_voice_s, 95)),
        "underruns": fig.underruns,
        "underrun_late_ms_max": _ms(max(fig.late_s, default=None)),
        "paused_turns": fig.paused_turns,
        "wrong_guesses": int(guesses - used),
        "guesses": int(guesses),
        "guesses_skipped": int(
            delta(before, after, "duplex_speculative_transcripts", 'outcome="skipped"')
        ),
        **{
            f"drafts_{o}": int(
                delta(before, after, "duplex_speculative_responses", f'outcome="{o}"')
            )
            for o in ("started", "used", "dropped")
        },
        "bargeins": fig.bargeins,
        "failed_responses": len(fig.failed),
        "client_errors": len(errors),
        "batch_requests": fig.batch_requests,
        "batch_first_audio_ms_p95": _ms(pct(fig.batch_first_s, 95)),
        "batch_failed": len(fig.batch_failed),
        "draft_work_wasted_pct": {},
        "device_busy_pct": {},
        "wait_max_ms": {},
        "batch_wait_max_ms": {},
        "batch_size_p50": {},
        "queue_wait_ms_p95": {},
        "server_cpu_pct": round(100 * cpu / wall, 1),
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }
    hb, ha = before["hists"], after["hists"]
    for stage in STAGES:
        uses = ("realtime", "draft_used", "draft_wasted", "speculative", "batch")
        outs = {
            u: delta(before, after, "duplex_stage_outputs", f'stage="{stage}",use="{u}"')
            for u in uses
        }
        busy = delta(before, after, "duplex_stage_busy_seconds", f'stage="{stage}"')
        if busy:
            row["device_busy_pct"][stage] = round(100 * busy / wall, 1)
        total = sum(outs.values())
        if total:
            row["draft_work_wasted_pct"][stage] = round(100 * outs["draft_wasted"] / total, 1)
        key = ("duplex_stage_batch_size", stage)
        if key in ha:
            row["batch_size_p50"][stage] = _num(bucket_quantile(hb.get(key, {}), ha[key], 0.5))
        key = ("duplex_stage_queue_wait_seconds", stage)
        if key in ha:
            q = quantile(hb.get(key, {}), ha[key], 0.95)
            row["queue_wait_ms_p95"][stage] = None if math.isnan(q) else round(q * 1000, 1)
            row["wait_max_ms"][stage] = top_bucket_ms(hb.get(key, {}), ha[key])
        key = ("duplex_scheduler_batch_wait_seconds", stage)
        if key in ha:
            row["batch_wait_max_ms"][stage] = top_bucket_ms(hb.get(key, {}), ha[key])
    firsts = (errors + fig.failed + fig.batch_failed)[:3]
    if firsts:
        row["first_errors"] = firsts
    return row


def passes(r: dict[str, Any]) -> bool:
    """The issue's pass rule for one run's step."""
    return (
        r["ttfa_ms_p95"] is not None
        and r["ttfa_ms_p95"] <= TTFA_MS
        and r.get("underruns_max", r["underruns"]) == 0
        and not r["client_errors"]
        and not r["failed_responses"]
        and not r["batch_failed"]
        and (r["batch_first_audio_ms_p95"] or 0.0) <= BATCH_FIRST_MS
    )


def passes_old(r: dict[str, Any]) -> bool:
    """``sim_sessions_p95_500ms``'s rule (issue 25): p95 <= 500 ms, no underrun or failure."""
    return (
        r["ttfa_ms_p95"] is not None
        and r["ttfa_ms_p95"] <= TTFA_MS
        and r.get("underruns_max", r["underruns"]) == 0
        and not r["client_errors"]
        and not r["failed_responses"]
    )


def best(runs: list[list[dict[str, Any]]], rule: Any) -> int:
    """The largest step that passes in every run."""
    steps = [row["sessions"] for row in runs[0]]
    ok = [n for i, n in enumerate(steps) if all(rule(run[i]) for run in runs)]
    return max(ok, default=0)


async def ladder(
    addr: str, pid: int, steps: list[int], args: argparse.Namespace
) -> list[dict[str, Any]]:
    rows = []
    for n in steps:
        row = await step(addr, pid, n, args.step_s, args)
        rows.append(row)
        print(json.dumps(row), flush=True)
        await asyncio.sleep(2.0)  # the sessions close; the stages drain
    return rows


def _median(xs: list[Any]) -> Any:
    vals = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return statistics.median(vals) if vals else None


MEDIANS = (
    "turns",
    "ttfa_ms_p50",
    "ttfa_ms_p95",
    "ttfa_from_voice_ms_p95",
    "underruns",
    "paused_turns",
    "wrong_guesses",
    "guesses",
    "guesses_skipped",
    "drafts_started",
    "drafts_used",
    "drafts_dropped",
    "bargeins",
    "batch_requests",
    "batch_first_audio_ms_p95",
    "server_cpu_pct",
    "loadavg_1m",
)
PER_STAGE = (
    "draft_work_wasted_pct",
    "device_busy_pct",
    "wait_max_ms",
    "batch_wait_max_ms",
    "batch_size_p50",
    "queue_wait_ms_p95",
)


def merge_runs(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each step's median over the runs (underruns and failures also as their maximum)."""
    rows = []
    for i, first in enumerate(runs[0]):
        same = [run[i] for run in runs]
        row: dict[str, Any] = {"sessions": first["sessions"]}
        for key in MEDIANS:
            row[key] = _median([r[key] for r in same])
        row["underruns_max"] = max(r["underruns"] for r in same)
        for key in ("client_errors", "failed_responses", "batch_failed"):
            row[key] = max(r[key] for r in same)
        for key in PER_STAGE:
            names = {st for r in same for st in r[key]}
            row[key] = {st: _median([r[key].get(st) for r in same]) for st in sorted(names)}
        row["passes_all_runs"] = all(passes(r) for r in same)
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| sessions | turns | p50 ms | p95 ms | voice p95 ms | underruns (max) | wrong guesses "
        "| barge-ins | draft waste % talker | batch first p95 ms (failed) | talker batch p50 "
        "| device busy % asr/llm/talker/codec | wait max ms asr/llm/talker/codec | server CPU % "
        "| pass |"
    )
    lines = [head, "|" + "---|" * 15]
    for r in rows:
        wait = "/".join(str(r["wait_max_ms"].get(st)) for st in STAGES)
        busy = "/".join(str(r["device_busy_pct"].get(st)) for st in STAGES)
        lines.append(
            f"| {r['sessions']} | {r['turns']} | {r['ttfa_ms_p50']} | {r['ttfa_ms_p95']} | "
            f"{r['ttfa_from_voice_ms_p95']} | {r['underruns']} ({r['underruns_max']}) | "
            f"{r['wrong_guesses']} | {r['bargeins']} | "
            f"{r['draft_work_wasted_pct'].get('talker')} | "
            f"{r['batch_first_audio_ms_p95']} ({r['batch_failed']}) | "
            f"{r['batch_size_p50'].get('talker')} | {busy} | {wait} | {r['server_cpu_pct']} | "
            f"{'yes' if r['passes_all_runs'] else 'no'} |"
        )
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """p95 commit -> first audio vs sessions, one line per ladder."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for res in results:
        rows = [r for r in res["steps"] if r["ttfa_ms_p95"] is not None]
        xs = [r["sessions"] for r in rows]
        name = res.get("ladder", res.get("policy", "?"))
        ax.plot(xs, [r["ttfa_ms_p95"] for r in rows], marker="o", label=f"{name} p95")
        for r in rows:
            if r["underruns"]:
                ax.annotate(f"{r['underruns']} underruns", (r["sessions"], r["ttfa_ms_p95"]))
    ax.axhline(TTFA_MS, color="r", ls="--", lw=1, label="500 ms goal")
    ax.set_xlabel("concurrent spoken sessions")
    ax.set_ylabel("commit -> first audio (ms)")
    ax.set_title(
        "simulated GPU timings (configs/sim/h200-costs.yaml), median per step", fontsize=10
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ----------------------------------------------------------------------------- the config
def bench_config(args: argparse.Namespace, tmp: Path) -> tuple[Path, dict[str, Any]]:
    """The config the ladder runs, written to ``tmp``, and what it is."""
    source = args.config or ROOT / "configs" / "sim-h200.yaml"
    raw = yaml.safe_load(Path(source).read_text())
    costs_path = cost_file_of(args.simulate) if args.simulate else None
    if costs_path is not None:
        raw["engine"] = simulate_config(raw["engine"], costs_path)
    else:
        costs_path = cost_file_of(source)
    eng = raw["engine"]
    if args.policy:
        eng.setdefault("scheduling", {})["policy"] = args.policy
    eng["vad"] = {"backend": "energy"}  # the clients share this machine: a cheap VAD
    eng.setdefault("duplex", {})["max_sessions"] = max(
        256, eng.get("duplex", {}).get("max_sessions", 0)
    )
    costs = load_costs(costs_path)
    devices: set[str] = set()
    for stage in eng["stages"].values():
        opts = stage.setdefault("options", {})
        if args.host_cpu:
            entry = costs.stages.get(opts.get("cost_key") or opts.get("role") or "")
            if entry is not None and entry.host_us_per_item is not None:
                opts["host_us_per_item"] = entry.host_us_per_item
        devices.update(stage.get("devices") or ["cpu"])
    path = tmp / "bench.yaml"
    path.write_text(yaml.safe_dump(raw))
    shared = len(devices) == 1 and next(iter(devices)).startswith("cuda")
    what = {
        "config": str(source),
        "costs": str(costs_path),
        "device": costs.device.name,
        "devices": sorted(devices),
        "one_device": shared,
        "scheduling": eng.get("scheduling", {}).get("policy", "serial"),
        "host_cpu": bool(args.host_cpu),
    }
    return path, what


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--config", type=Path, help="a config users deploy (default: configs/sim-h200.yaml)"
    )
    ap.add_argument("--simulate", type=Path, help="a cost file, or a sim config naming one")
    ap.add_argument(
        "--policy", choices=["serial", "capacity"], help="override the scheduling policy"
    )
    ap.add_argument("--steps", default="16,24,32,48,64")
    ap.add_argument("--step-s", type=float, default=60.0)
    ap.add_argument("--runs", type=int, default=3, help="ladders to run (median per step)")
    ap.add_argument("--wrong-guess-pct", type=float, default=20.0)
    ap.add_argument("--bargein-pct", type=float, default=10.0)
    ap.add_argument("--batch-rps", type=float, default=1.0)
    ap.add_argument("--host-cpu", action="store_true", help="burn the cost file's host CPU")
    ap.add_argument("--quick", action="store_true", help="development: 16,32 for 20 s, one run")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", nargs="+", type=Path, metavar="JSON")
    ap.add_argument("--png", type=Path, default=ROOT / "docs" / "figures" / "gpu-sim-ladder.png")
    args = ap.parse_args()
    if args.plot:
        plot([json.loads(p.read_text()) for p in args.plot], args.png)
        return 0
    if args.quick:
        args.steps, args.step_s, args.runs = "16,32", 20.0, 1
    steps = [int(s) for s in args.steps.split(",")]
    load0, probe0 = [round(x, 2) for x in os.getloadavg()], probe_ms()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        cfg, what = bench_config(args, Path(tmp))
        print(f"ladder on {what}", flush=True)
        for _ in range(args.runs):
            with running_server(cfg, quiet=True) as (addr, pid):
                runs.append(asyncio.run(ladder(addr, pid, steps, args)))
    rows = merge_runs(runs)
    n_dev = len(what["devices"])
    key = "sim_sessions_one_gpu" if what["one_device"] else f"sim_sessions_{n_dev}_devices"
    out: dict[str, Any] = {
        "label": f"simulated GPU timings ({what['costs']} cost model), not a GPU",
        "ladder": f"{Path(what['config']).name}{' one device' if what['one_device'] else ''}",
        **what,
        "workload": {
            "wrong_guess_pct": args.wrong_guess_pct,
            "bargein_pct": args.bargein_pct,
            "batch_rps": args.batch_rps,
            "step_s": args.step_s,
            "vad": "energy (bench)",
            "turn_detection": "server_vad 500 ms",
        },
        "machine_cpus": os.cpu_count(),
        "loadavg_start": load0,
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "probe_ms": [probe0, probe_ms()],
        key: best(runs, passes),
        f"{key}_per_run": [best([run], passes) for run in runs],
        "sim_sessions_p95_500ms": best(runs, passes_old),
        "steps": rows,
        "runs": runs,
    }
    print(f"{out['ladder']}, {args.runs} run(s), median per step (simulated GPU timings):")
    print(table(rows))
    print(
        f"{key} = {out[key]} (per run {out[key + '_per_run']}); sim_sessions_p95_500ms = "
        f"{out['sim_sessions_p95_500ms']}"
    )
    print(f"load average at start {load0}, end {out['loadavg_end']}; probe {out['probe_ms']} ms")
    print(json.dumps({k: v for k, v in out.items() if k not in ("steps", "runs")}))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
