"""Which stage workers of this process are computing right now.

On a small CPU machine the stages share the cores: one thread each keeps ASR, LLM and TTS
from spin-waiting on each other's cores when they run at the same time (several sessions,
or the LLM decoding while the TTS speaks its first clause). But a stage that runs *alone*
(the LLM answering one user while nothing else computes) leaves a core idle that way. A
backend that can change its thread count between steps (llama.cpp, per token) asks
:func:`others_busy` before each step and uses more threads only when no other stage works.

The stage runtimes (engine/stages/workers.py, engine/stages/batching.py) mark every unit of
work with :func:`working`: a threaded request from its first output to its last, a batched
step for its duration.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["busy", "others_busy", "working"]

_lock = threading.Lock()
_busy: dict[str, int] = {}


@contextmanager
def working(name: str) -> Iterator[None]:
    """Mark the stage replica ``name`` as computing for the duration of the block."""
    with _lock:
        _busy[name] = _busy.get(name, 0) + 1
    try:
        yield
    finally:
        with _lock:
            left = _busy[name] - 1
            if left:
                _busy[name] = left
            else:
                del _busy[name]


def others_busy(name: str) -> bool:
    """True while any stage replica other than ``name`` is computing."""
    with _lock:
        return any(k != name for k in _busy)


def busy() -> dict[str, int]:
    """The replicas computing now, and how many units of work each (for tests, metrics)."""
    with _lock:
        return dict(_busy)
