"""The audio kit is a leaf: importing every module of it loads no engine or server module."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODULES = sorted(p.stem for p in (ROOT / "audio_kit").glob("*.py") if p.stem != "__init__")


def test_the_kit_has_its_modules() -> None:
    assert MODULES == ["denoise", "echo", "fir", "g711", "pcm", "smart_turn", "vad"]


def test_importing_the_kit_loads_neither_side() -> None:
    code = (
        "import importlib, sys\n"
        f"for m in {MODULES!r}: importlib.import_module('audio_kit.' + m)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('engine', 'duplex_server', 'duplex_client'))\n"
        "print(bad); sys.exit(1 if bad else 0)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
