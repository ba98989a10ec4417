"""The engine's audio formats: what the server appends and what durations mean."""

from __future__ import annotations

from typing import Final

#: Input audio the engine accepts (``AppendCall.audio``): PCM16 mono little endian at this rate.
INPUT_RATE: Final = 16000
#: Output rate the server asks the engine for (it re-encodes for the client's format).
OUTPUT_RATE: Final = 24000
BYTES_PER_SAMPLE: Final = 2  # PCM16 mono


def duration_ms(nbytes: int, sample_rate: int) -> float:
    """Milliseconds of ``nbytes`` of PCM16 mono audio at ``sample_rate``."""
    return nbytes / BYTES_PER_SAMPLE * 1000.0 / sample_rate


def input_ms(nbytes: int) -> float:
    """Milliseconds of ``nbytes`` of engine input audio (:data:`INPUT_RATE`)."""
    return duration_ms(nbytes, INPUT_RATE)


def input_bytes(ms: float) -> int:
    """Whole samples of engine input audio covering ``ms`` (an even byte count)."""
    return int(ms * INPUT_RATE / 1000.0) * BYTES_PER_SAMPLE
