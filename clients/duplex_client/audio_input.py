"""Audio for the SDK's input: any mono samples as PCM16 bytes at the session's rate, and WAV
files read with the standard library."""

from __future__ import annotations

import wave
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import soxr

AudioInput = bytes | npt.NDArray[np.int16] | npt.NDArray[np.float32] | npt.NDArray[np.float64]


def to_pcm16(audio: AudioInput, rate: int, target_rate: int) -> bytes:
    """Mono int16 or float (-1..1) samples, or PCM16 bytes, at ``target_rate`` as PCM16 bytes."""
    if isinstance(audio, bytes):
        if rate == target_rate:
            return audio
        samples: npt.NDArray[Any] = np.frombuffer(audio, dtype="<i2")
    else:
        samples = np.asarray(audio)
    if samples.dtype.kind == "f":
        samples = (np.clip(samples, -1.0, 1.0) * 32767.0).astype(np.int16)
    if rate != target_rate:
        samples = soxr.resample(samples.astype(np.int16), rate, target_rate)
    return np.asarray(samples, dtype="<i2").tobytes()


def read_wav(path: str | Path) -> tuple[bytes, int]:
    """PCM16 mono bytes and sample rate of a WAV file (stdlib ``wave``; mono 16-bit only)."""
    with wave.open(str(path), "rb") as w:
        if w.getsampwidth() != 2 or w.getnchannels() != 1:
            raise ValueError(f"{path}: need mono 16-bit PCM WAV")
        return w.readframes(w.getnframes()), w.getframerate()
