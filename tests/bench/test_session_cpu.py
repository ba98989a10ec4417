"""bench/session_cpu.py: the server and the transport floor under the same clients, back to
back, and their ratio (issue 42's CPU measure)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_one_quick_run_measures_both_and_their_ratio(tmp_path: Path) -> None:
    out = tmp_path / "cpu.json"
    args = ["--runs", "1", "--quick", "--sessions", "4", "--json", str(out)]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "session_cpu.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    (run,) = result["runs"]
    server, floor = run["server_cpu_ms_per_session_s"], run["floor_cpu_ms_per_session_s"]
    assert server > 0 and floor > 0  # both processes were measured working
    assert run["cpu_ratio"] == round(server / floor, 2) == result["cpu_ratio"]
    assert run["probe_ms"] > 0 and "loadavg_1m" in run
    assert "cpu_ratio" in proc.stdout and "goal <= 1.5x" in proc.stdout
