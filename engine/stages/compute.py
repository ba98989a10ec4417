"""Which stage replicas of this process are computing right now, as the stage runtimes mark it.

On a small CPU machine the stages share the cores: one thread each keeps ASR, LLM and TTS
from spin-waiting on each other's cores when they run at the same time (several sessions,
or the LLM decoding while the TTS speaks its first clause). But a stage that runs *alone*
(the LLM answering one user while nothing else computes) leaves a core idle that way. A
backend that can change its thread count between steps (llama.cpp, per token) asks
:func:`others_busy` before each step and uses more threads only when no other stage works.

The stage runtimes mark every unit of work with :func:`working`: the one-request-at-a-time
runtime (engine/stages/threaded.py) a request for the whole of its ``run``, the batching
runtime (engine/stages/batching.py) each step for its duration.

*Urgent* work: a response's first clause in speech (``TtsRequest.first``) is what its first
audio waits for, while the same response's LLM goes on decoding text that is needed only
seconds later (the clause is ~1 s of audio; the LLM decodes ~100 tokens a second). On two
cores the two halve each other's speed (Piper's first clause: ~60 ms alone with two
threads, ~150-240 ms beside the decoding LLM). So the threaded runtime marks such a
request with :func:`urgent` under its response's group (its request id without the last
part: ``sess_x/e0/draft3`` of ``sess_x/e0/draft3/tts0``), and a backend that decodes step by
step (llama.cpp) calls :func:`wait_urgent` with its own group between steps: it pauses
while its own response's first clause is spoken, never for another response.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

__all__ = [
    "busy",
    "group_of",
    "others_busy",
    "urgent",
    "urgent_groups",
    "wait_urgent",
    "working",
]

_lock = threading.Lock()
_busy: dict[str, int] = {}
_urgent: dict[str, int] = {}
_urgent_done = threading.Condition(_lock)


@contextmanager
def _held(table: dict[str, int], key: str) -> Iterator[None]:
    """Count one unit under ``key`` in ``table`` for the duration of the block; the last to
    leave removes the key and wakes the waiters of :func:`wait_urgent`."""
    with _lock:
        table[key] = table.get(key, 0) + 1
    try:
        yield
    finally:
        with _lock:
            left = table[key] - 1
            if left:
                table[key] = left
            else:
                del table[key]
                _urgent_done.notify_all()


def working(name: str) -> AbstractContextManager[None]:
    """Mark the stage replica ``name`` as computing for the duration of the block."""
    return _held(_busy, name)


def others_busy(name: str) -> bool:
    """True while any stage replica other than ``name`` is computing."""
    with _lock:
        return any(k != name for k in _busy)


def busy() -> dict[str, int]:
    """The replicas computing now, and how many units of work each (for tests, metrics)."""
    with _lock:
        return dict(_busy)


def group_of(request_id: str) -> str:
    """The response a stage request belongs to: its id without the last part."""
    return request_id.rsplit("/", 1)[0]


def urgent(group: str) -> AbstractContextManager[None]:
    """Mark work that ``group``'s first output waits for, for the duration of the block."""
    return _held(_urgent, group)


def wait_urgent(group: str, cancelled: threading.Event | None, limit_s: float) -> float:
    """Block while urgent work of ``group`` runs, at most ``limit_s`` in all, and not past
    ``cancelled`` (checked every 10 ms); returns the seconds waited."""
    if group not in _urgent:  # unlocked peek: the common case costs nothing
        return 0.0
    start = time.monotonic()
    deadline = start + limit_s
    with _lock:
        while group in _urgent and not (cancelled is not None and cancelled.is_set()):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            _urgent_done.wait(min(left, 0.01))
    return time.monotonic() - start


def urgent_groups() -> dict[str, int]:
    """The groups with urgent work now, and how many units each (for tests, metrics)."""
    with _lock:
        return dict(_urgent)
