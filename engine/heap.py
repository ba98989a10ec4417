"""Give freed heap memory back to the operating system (glibc ``malloc_trim``).

A speech server's allocations come and go in large, varied sizes (a TTS sentence's tensors,
an ASR window's buffers), from many threads. glibc keeps what is freed in per-thread arenas
for reuse and returns little of it on its own, so the resident size of a long-running
server follows the high-water mark of every arena rather than what is live, and it creeps
up as new sizes show up. ``malloc_trim(0)`` releases the free pages of every arena: with
Piper's onnxruntime arena off (engine/stages/tts_piper.py), 150 sentences of 2-40 words
left a 156 MB process at 749 MB, and 149 MB after a trim. The orchestrator's reaper calls
:func:`trim_heap` every ``engine.duplex.heap_trim_interval_s``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)


def _load() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        fn = ctypes.CDLL(name).malloc_trim  # glibc only (not musl, not macOS)
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


_MALLOC_TRIM = _load()


def can_trim() -> bool:
    """Whether this C library can give free heap pages back (glibc)."""
    return _MALLOC_TRIM is not None


def trim_heap() -> bool:
    """Release the free pages of every malloc arena to the OS (blocking: call it from a
    worker thread; ctypes drops the GIL for the call). False where the C library has no
    ``malloc_trim`` (then this does nothing)."""
    if _MALLOC_TRIM is None:
        return False
    _MALLOC_TRIM(0)
    return True
