"""The partials child (pocketsphinx) is best effort: it runs below the server's CPU
priority, so on a busy machine the stages that answer turns get the cores first."""

from __future__ import annotations

import os
import time

import pytest

from engine.partials import PartialTranscriber
from engine.partials_child import NICENESS

pytestmark = pytest.mark.models


def _nice(pid: int) -> int:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        return int(f.read().rsplit(")", 1)[1].split()[16])  # field 19: nice


def test_the_partials_child_runs_at_a_lower_cpu_priority() -> None:
    got: list[str] = []
    tr = PartialTranscriber(lambda sid, gen, text: got.append(text), max_streams=1)
    tr.start()
    try:
        assert tr._proc is not None
        child = tr._proc.pid
        want = min(19, os.nice(0) + NICENESS)
        deadline = time.monotonic() + 30
        while _nice(child) != want and time.monotonic() < deadline:
            time.sleep(0.05)  # the child lowers its priority once its imports are done
        assert _nice(child) == want
        assert _nice(os.getpid()) == os.nice(0)  # the server's own priority is unchanged
    finally:
        tr.close()
