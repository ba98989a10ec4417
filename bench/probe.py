"""The machine probe printed beside every timing figure: machines of one kind differ up to
2x, so a figure is read with how fast this machine's cores were when it was measured."""

from __future__ import annotations

import time


def probe_ms() -> float:
    """A fixed pure-Python workload (ms): how fast this machine's cores are right now."""
    t = time.perf_counter()
    acc = 0.0
    for i in range(1_000_000):
        acc += i**0.5
    return round((time.perf_counter() - t) * 1000, 1)
