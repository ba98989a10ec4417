"""A CI-sized soak: ``bench/soak.py`` against the real server (``duplex-server serve`` on the
test stage), six sessions doing back-to-back spoken turns with barge-ins, drops and resumes,
sessions abandoned mid-way, and the LLM worker crashed and restarted now and then.

Asserts zero failures (every event in order, every resume accepted, every turn ended as
expected, the turns hit by a crash ended ``failed`` and their sessions went on), zero
sessions and zero engine slots left once the grace period (1 s here) has passed, and that
resident memory stops growing after the warm-up (see ``RSS_SLOPE_MAX_MB_PER_H``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server.harness import ROOT, UNIT

MINUTES = 3.0
#: RSS reaches the soak's working set within ~30 s (8 sessions at --pace 6: 107 -> 122 MB,
#: then 121-128 MB for 10 minutes, 2026-12-04); the slope is read over the last 2 minutes
WARMUP_MIN = 1.0
#: The bound on the RSS slope after warm-up, in MB/h. The leaks this soak found grew RSS at
#: 550-900 MB/h (a session whose engine session had ended stayed live in the front end, with
#: its journal) and ~2.5 GB/h (the test stage kept every request). What it must tell apart
#: from a leak: the RSS of a healthy server under this load moves within ~4 MB, and the slope
#: of 2-minute windows of a 10-minute run ranged -48..+92 MB/h (+13 MB/h over the 8 minutes
#: after warm-up). Before ended sessions were freed at once (they waited in reference
#: cycles for the cyclic GC), RSS rose ~27 MB and fell every ~30 s, and 1-minute windows
#: read -1068..+1606 MB/h: the old bound of 300 MB/h over 1 minute passed or failed by luck.
RSS_SLOPE_MAX_MB_PER_H = 200.0


@pytest.mark.long  # make test-long (~3 min), a CI tier after make test
def test_ci_soak_keeps_memory_flat_and_returns_every_session(tmp_path: Path) -> None:
    out, png = tmp_path / "soak.json", tmp_path / "soak.png"
    cmd = [sys.executable, str(ROOT / "bench" / "soak.py")]
    cmd += ["--config", str(ROOT / "configs" / "test.yaml"), "--minutes", str(MINUTES)]
    cmd += ["--sessions", "8", "--grace", "5", "--chaos", "--sample-s", "1", "--pace", "6"]
    cmd += ["--warmup-min", str(WARMUP_MIN), "--timeout", str(30 * UNIT)]
    cmd += ["--json", str(out), "--plot", str(png)]
    print(" ".join(cmd))
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240 * UNIT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    print({k: v for k, v in result.items() if k != "samples"})
    assert result["failures"] == 0, result["failure_details"]
    assert result["leftover_sessions"] == 0
    assert result["leftover_slots"] == 0
    assert result["sessions_by_state_last"] == {"attached": 0, "closing": 0, "detached": 0}
    # it did what it says: every kind of turn and end, and crashes that hit turns
    assert set(result["turns"]) == {"turn", "cancel", "voice", "drop", "chaos"}
    assert set(result["ends"]) == {"close", "plain", "abandon"}
    assert result["chaos_affected_turns"] >= result["turns"]["chaos"] > 0
    assert result["sessions_run"] >= 30
    # every part of what sessions hold came back
    assert result["session_bytes_last"] and not any(result["session_bytes_last"].values())
    assert result["rss_slope_mb_per_h"] <= RSS_SLOPE_MAX_MB_PER_H, result["samples"]
    assert png.stat().st_size > 10_000


@pytest.mark.long  # ~30 s of real-time speech: make test-long
def test_realtime_client_speaks_at_real_time_and_hears_answers_out(tmp_path: Path) -> None:
    """``--client realtime`` (the default on real models): speech streamed at real time, each
    answer heard out before the next turn; the first-audio waits are reported."""
    out = tmp_path / "soak.json"
    cmd = [sys.executable, str(ROOT / "bench" / "soak.py")]
    cmd += ["--config", str(ROOT / "configs" / "test.yaml"), "--minutes", "0.4"]
    cmd += ["--sessions", "2", "--grace", "1", "--sample-s", "2", "--pace", "4"]
    cmd += ["--client", "realtime", "--timeout", str(30 * UNIT), "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180 * UNIT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["client"] == "realtime"
    assert result["failures"] == 0, result["failure_details"]
    assert result["leftover_sessions"] == 0 and result["leftover_slots"] == 0
    waits = result["first_audio_s"]
    assert waits["n"] >= 2 and 0 < waits["p50"] <= waits["max"] < 30 * UNIT
    # real time: a turn takes its 1.5 s of speech and silence to send, and then (but for a
    # cancel) the answer's ~3.5 s of audio to play; in 24 s two sessions did at most ~10
    # such turns (burst, with the answer sent at 4x real time: several times as many)
    heard = sum(n for kind, n in result["turns"].items() if kind != "cancel")
    assert 0 < heard <= 2 * (24 / 5.0 + 1), result["turns"]
