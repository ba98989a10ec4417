"""bench/vad_delay.py: when the VAD decides, by input format, against 16 kHz PCM. G.711 at
8 kHz is heard with no resampling delay (the input lane's 2x interpolation); 24 kHz input
goes through soxr, whose delay the bench shows."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_g711_speech_is_decided_as_soon_as_at_16k_and_24k_shows_soxrs_delay(
    tmp_path: Path,
) -> None:
    out = tmp_path / "vad.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "vad_delay.py"), "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    formats = json.loads(out.read_text())["formats"]
    base = formats["pcm16 16 kHz"]
    assert base["events"] >= 10 and base["vad_delay_ms_max"] == 0.0
    g711 = formats["g711_ulaw 8 kHz"]
    assert g711["events"] >= 10
    assert g711["vad_delay_ms_p50"] <= 0.0 and g711["vad_delay_ms_max"] <= 20.0  # was 50 / 140
    hi = formats["pcm16 24 kHz"]
    assert hi["events"] == base["events"] and hi["vad_delay_ms_mean"] > 5.0
    assert "pcm16 24 kHz" in proc.stdout  # the table
