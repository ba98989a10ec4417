"""What a live session costs the server in CPU, against the transport floor, back to back.

    python bench/session_cpu.py [--runs 3] [--sessions 100] [--quick] [--json PATH]

Each run measures, one right after the other on the same machine:

* the server: ``bench/realtime.py --workers 2 --binary --chunk-ms 20 --sessions N`` (engine
  process + 2 front ends, real clients on loopback streaming 20 ms binary PCM16 frames in real
  time, server VAD, a spoken test-stage answer running); its CPU ms per session-second at the
  N-session step (engine and front ends summed; the step's connects and closes included);
* the floor: ``bench/ws_floor.py --speak --sessions N``: the same clients against a bare
  uvicorn + Starlette WebSocket app that only receives the frames and sends the same audio
  deltas (no decoding, VAD, session or engine).

``--quick``: 3 s steps instead of 8 (a smoke run: the connects weigh more in it). The ratio
server / floor is issue 42's measure (goal <= 1.5x). Prints a row per run with the
load average and the machine probe, then the medians. JSON: ``server_cpu_ms_per_session_s``,
``floor_cpu_ms_per_session_s``, ``cpu_ratio`` (medians), ``runs``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from probe import probe_ms

HERE = Path(__file__).resolve().parent


def _bench(script: str, args: list[str], out: Path) -> dict[str, Any]:
    """Run one bench as its own process (its own server and clients) and read its JSON."""
    cmd = [sys.executable, str(HERE / script), *args, "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"{script} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def _at(rows: list[dict[str, Any]], sessions: int, what: str) -> dict[str, Any]:
    row = next((r for r in rows if r["sessions"] == sessions), None)
    if row is None or row.get("failed") or row.get("ok") != sessions:
        raise RuntimeError(f"{what}: the {sessions}-session step did not pass: {row}")
    return row


def one_run(sessions: int, tmp: Path, quick: bool = False) -> dict[str, Any]:
    probe = probe_ms()
    server = _bench(
        "realtime.py",
        ["--workers", "2", "--binary", "--chunk-ms", "20", "--sessions", str(sessions)]
        + (["--quick"] if quick else []),
        tmp / "server.json",
    )
    srow = _at(server["load_steps"], sessions, "server")
    seconds = ["--seconds", "3"] if quick else []
    floor = _bench(
        "ws_floor.py", ["--speak", "--sessions", str(sessions), *seconds], tmp / "floor.json"
    )
    frow = _at(floor["steps"], sessions, "floor")
    s, f = srow["server_cpu_ms_per_session_s"], frow["server_cpu_ms_per_session_s"]
    return {
        "server_cpu_ms_per_session_s": s,
        "floor_cpu_ms_per_session_s": f,
        "cpu_ratio": round(s / f, 2),
        "server_p99_ms": round(srow["p99_ms"], 2),
        "loadavg_1m": round(os.getloadavg()[0], 2),
        "probe_ms": probe,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--sessions", type=int, default=100)
    parser.add_argument("--quick", action="store_true", help="3 s steps (a smoke run)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    runs = []
    print(f"{args.sessions} sessions, CPU ms per session-second (server: engine + 2 front ends)")
    print(
        f"{'run':>4} {'server':>8} {'floor':>7} {'ratio':>6} {'p99 ms':>7} {'load':>5} {'probe':>6}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            r = one_run(args.sessions, Path(tmp), args.quick)
            runs.append(r)
            print(
                f"{i + 1:>4} {r['server_cpu_ms_per_session_s']:>8.2f}"
                f" {r['floor_cpu_ms_per_session_s']:>7.2f} {r['cpu_ratio']:>5.2f}x"
                f" {r['server_p99_ms']:>7.2f} {r['loadavg_1m']:>5.2f} {r['probe_ms']:>6.0f}",
                flush=True,
            )
    result = {
        "sessions": args.sessions,
        "server_cpu_ms_per_session_s": statistics.median(
            r["server_cpu_ms_per_session_s"] for r in runs
        ),
        "floor_cpu_ms_per_session_s": statistics.median(
            r["floor_cpu_ms_per_session_s"] for r in runs
        ),
        "cpu_ratio": statistics.median(r["cpu_ratio"] for r in runs),
        "runs": runs,
    }
    print(
        f"median: server {result['server_cpu_ms_per_session_s']:.2f}, floor"
        f" {result['floor_cpu_ms_per_session_s']:.2f} ms per session-second;"
        f" cpu_ratio {result['cpu_ratio']:.2f}x (goal <= 1.5x)"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
