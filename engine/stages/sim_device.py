"""The simulated device the sim stages (engine/stages/sim.py) run their calls and steps on.

A :class:`SimDevice` is one device's time. A call or a decode step *occupies* it for its
cost, and every other stage on the same device waits meanwhile, in the order they asked
(time-slicing, as stages in separate processes share a GPU without MPS). Stages placed on
the same ``cuda:N`` share one device (one GPU carrying the whole route); a stage on ``cpu``
(or ``auto``) gets a device of its own (the four-device simulation: every stage in
parallel).

Time runs on the event loop's clock against the device's running deadline, so a late
wakeup of the loop does not slow the simulated device down: a stage that was ready when
the device came free starts then (``ready``), not when the loop got round to it; its
outputs then come out at once, and the device catches up.

Host CPU cost (optional): :func:`burn` spends real CPU time in this process, the work a
real deployment's engine process does per token or frame beside the device (vLLM's output
handling, the codec's kernel launches).
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

_KEEP = 4096


class SimDevice:
    """One device's clock (see the module docstring). Create and use on one loop."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.free_at = 0.0  # loop clock: when its last call or step ends
        self.busy_s = 0.0  # time occupied, all stages
        self._lock = asyncio.Lock()
        #: (stage, start, end) of the last calls and steps, loop clock
        self.spans: deque[tuple[str, float, float]] = deque(maxlen=_KEEP)

    @asynccontextmanager
    async def turn(self) -> AsyncIterator[None]:
        """Wait for the device (first come, first served); hold it for the block."""
        async with self._lock:
            yield

    async def occupy(self, stage: str, ready: float, ms: float) -> tuple[float, float]:
        """Inside :meth:`turn`: run a call or step of ``ms`` that could start at ``ready``
        (loop clock); returns its (start, end) once it has ended."""
        loop = asyncio.get_running_loop()
        start = max(ready, self.free_at)
        end = start + ms / 1000.0
        self.free_at = end
        self.busy_s += end - start
        self.spans.append((stage, start, end))
        await asyncio.sleep(max(0.0, end - loop.time()))
        return start, end


_DEVICES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, SimDevice]] = (
    weakref.WeakKeyDictionary()
)


def device_for(placement: str, owner: str) -> SimDevice:
    """The device a sim replica placed on ``placement`` runs on, on the running loop: the one
    shared ``cuda:N``, else a device of its own (named after ``owner``)."""
    loop = asyncio.get_running_loop()
    if not placement.startswith("cuda"):
        return SimDevice(f"{owner}@{placement}")
    devices = _DEVICES.setdefault(loop, {})
    dev = devices.get(placement)
    if dev is None:
        dev = devices[placement] = SimDevice(placement)
    return dev


def burn(seconds: float) -> None:
    """Spend ``seconds`` of this thread's CPU (a busy loop that holds the GIL, as Python
    output handling does)."""
    end = time.thread_time() + seconds
    x = 0
    while time.thread_time() < end:
        for _ in range(200):
            x += 1


__all__ = ["SimDevice", "burn", "device_for"]
