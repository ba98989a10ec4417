"""The talker's frame logits processor: per-row loop vs one batched mask, ms and ops per step.

    python bench/talker_logits.py [--device cpu|cuda|cuda:N] [--rows 1,32,128,256] [--json PATH]

The talker's vLLM logits processor (engine/stages/talker_logits.py) masks every decode
step's logits to the codebook of each request's next frame position. This times one step of
both versions on the Orpheus layout (vocabulary 156,940, fp32 logits, 7 codebooks x 4096
codes from audio base 128266, end id 128258 at frame starts) for batches of 1/32/128/256
requests: *per_row* (engine/stages/talker_mask.py ``reference_apply``, the loop the
processor shipped with: a clone, a fill and assignments per row) and *vectorized*
(``FrameMaskRows.apply``, what the processor runs now). Each step re-reads the requests'
output lengths (every request gains one token per step, as in decoding) and masks a fresh
copy of the logits; the median of ``--steps`` steps after ``--warmup`` is reported (CUDA:
synchronized before and after each step). Both versions must give the same logits (checked
at every batch size before timing). *ops per step*: top-level aten ops of one step, counted
with torch.profiler: constant for the vectorized mask, growing with the rows for the loop.

Imports only torch and engine/stages/talker_mask.py, so it runs on a bare GPU machine that
has torch and nothing else of the project.

JSON keys: ``{per_row,vectorized}_ms_p50_at_{rows}``, ``{per_row,vectorized}_ops_per_step_at_
{rows}``, ``speedup_at_{rows}`` (per_row / vectorized), and details under ``by_rows``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.stages.talker_mask import FrameMaskRows, Spec, reference_apply  # noqa: E402

VOCAB = 156_940  # Orpheus: Llama-3's 128,256 + custom tokens
ORPHEUS: Spec = (128_266, 4096, 7, (128_258,))  # audio base, codebook size, frame, end ids
VERSIONS = ("per_row", "vectorized")


def resolve_device(name: str) -> torch.device:
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise SystemExit(
                f"--device {name}: torch {torch.__version__} sees no CUDA device "
                "(torch.cuda.is_available() is False); run with --device cpu"
            )
        return torch.device("cuda:0" if name == "cuda" else name)
    if name != "cpu":
        raise SystemExit(f"--device {name}: expected cpu, cuda or cuda:N")
    return torch.device("cpu")


def batch(rows: int) -> tuple[FrameMaskRows, list[list[int]]]:
    """``rows`` Orpheus requests at every frame position (rows % 7 spread over 0..6)."""
    mask = FrameMaskRows()
    outputs = [[0] * (40 + i % 7) for i in range(rows)]
    for index, output_ids in enumerate(outputs):
        mask.add(index, ORPHEUS, output_ids)
    return mask, outputs


def count_ops(fn: Callable[[torch.Tensor], torch.Tensor], logits: torch.Tensor) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn(logits)
    return sum(1 for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None)


def bench_rows(rows: int, device: torch.device, steps: int, warmup: int) -> dict[str, Any]:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    gen = torch.Generator(device=device).manual_seed(rows)
    source = torch.randn(rows, VOCAB, generator=gen, device=device, dtype=torch.float32)
    logits = torch.empty_like(source)
    mask, outputs = batch(rows)
    fns: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "per_row": lambda x: reference_apply(x, mask.rows),
        "vectorized": mask.apply,
    }
    want = fns["per_row"](source.clone())
    got = fns["vectorized"](source.clone())
    if not torch.equal(got, want):
        raise SystemExit(f"{rows} rows: the vectorized mask differs from the per-row one")
    out: dict[str, Any] = {}
    for version, fn in fns.items():
        times: list[float] = []
        for step in range(warmup + steps):
            logits.copy_(source)
            for output_ids in outputs:  # one token per request per step
                output_ids.append(0)
            sync()
            t0 = time.perf_counter()
            fn(logits)
            sync()
            if step >= warmup:
                times.append((time.perf_counter() - t0) * 1000)
        logits.copy_(source)
        out[version] = {
            "ms_p50": statistics.median(times),
            "ms_min": min(times),
            "ms_max": max(times),
            "ops_per_step": count_ops(fn, logits),
        }
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    ap.add_argument("--rows", default="1,32,128,256", help="batch sizes, comma-separated")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per batch size")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    device = resolve_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = [int(r) for r in args.rows.split(",")]
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs"
    result: dict[str, Any] = {
        "machine": machine,
        "device": str(device),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "vocab": VOCAB,
        "steps": args.steps,
        "loadavg_1m_start": round(os.getloadavg()[0], 2),
    }
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(device)
    where = result.get("gpu", f"{torch.get_num_threads()} torch threads")
    print(f"machine: {machine}; {device} ({where}); torch {torch.__version__}", flush=True)
    by_rows: dict[str, Any] = {}
    for rows in sizes:
        fig = by_rows[str(rows)] = bench_rows(rows, device, args.steps, args.warmup)
        for version in VERSIONS:
            result[f"{version}_ms_p50_at_{rows}"] = fig[version]["ms_p50"]
            result[f"{version}_ops_per_step_at_{rows}"] = fig[version]["ops_per_step"]
        result[f"speedup_at_{rows}"] = fig["per_row"]["ms_p50"] / fig["vectorized"]["ms_p50"]
    result["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
    result["by_rows"] = by_rows
    print()
    print(f"{'rows':>5} | {'per_row ms p50':>14} | {'vectorized ms p50':>17} | {'speedup':>7} |")
    print(f"{'':>5} | {'(ops/step)':>14} | {'(ops/step)':>17} | {'':>7} |")
    for rows in sizes:
        fig = by_rows[str(rows)]
        pr, vec = fig["per_row"], fig["vectorized"]
        print(
            f"{rows:>5} | {pr['ms_p50']:>8.3f} ({pr['ops_per_step']:>4}) | "
            f"{vec['ms_p50']:>11.3f} ({vec['ops_per_step']:>3}) | "
            f"{result[f'speedup_at_{rows}']:>6.1f}x |"
        )
    print(f"load average (1 min): {result['loadavg_1m_start']} -> {result['loadavg_1m_end']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
