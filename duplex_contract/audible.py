"""When audio becomes audible: the one definition the server, the benches and the SDK share.

A latency figure that stops at the first audio *byte* flatters a voice that starts with
silence (TTS engines pad 75-341 ms before speech); a listener waits for the first *audible*
sample. Audible: a 5 ms window whose RMS reaches -40 dBFS (:data:`AUDIBLE_DBFS`).
:func:`first_audible` finds it in a clip; :class:`AudibleStart` times it in a stream that a
player starts playing on its first byte (``duplex-client talk``, the latency benches), and
the engine trims a TTS's leading silence to it (``audio_kit.pcm.lead_trim``).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

#: Audible: a 5 ms window whose RMS reaches -40 dBFS
AUDIBLE_DBFS = -40.0
WINDOW_MS = 5.0


def first_audible(
    audio: npt.NDArray[np.float32], sample_rate: int, dbfs: float = AUDIBLE_DBFS
) -> int | None:
    """The first sample of the first 5 ms window (from the start) of float32 ``audio`` in
    [-1, 1] whose RMS reaches ``dbfs`` (a last, shorter window counts too); None when no
    window does."""
    samples = np.asarray(audio, dtype=np.float32)
    win = max(1, int(sample_rate * WINDOW_MS / 1000))
    level = 10 ** (dbfs / 20)
    whole = samples.size // win
    if whole:
        frames = samples[: whole * win].reshape(whole, win)
        rms = np.sqrt(np.mean(frames * frames, axis=1))
        loud = np.nonzero(rms >= level)[0]
        if loud.size:
            return int(loud[0]) * win
    tail = samples[whole * win :]
    if tail.size and float(np.sqrt(np.mean(np.square(tail, dtype=np.float64)))) >= level:
        return whole * win
    return None


class AudibleStart:
    """When a listener hears the first audible sample of a stream of PCM16 pieces that a
    player starts playing as soon as the first byte arrives: the piece holding that sample
    plays it ``offset`` after the stream's start, or when it arrives if it comes later (the
    player ran dry). ``feed`` each piece with its arrival time (s, any clock); ``at`` is
    that moment once heard (None before), ``first_byte_at`` the first piece's arrival."""

    def __init__(self, dbfs: float = AUDIBLE_DBFS) -> None:
        self.dbfs = dbfs
        self.first_byte_at: float | None = None
        self.at: float | None = None
        self._played_s = 0.0  # audio before this piece, in s

    def feed(self, arrived_s: float, pcm: bytes, sample_rate: int) -> None:
        if self.at is not None or not pcm:
            return
        if self.first_byte_at is None:
            self.first_byte_at = arrived_s
        samples = np.frombuffer(pcm[: len(pcm) - len(pcm) % 2], dtype="<i2")
        first = first_audible(samples.astype(np.float32) / 32768.0, sample_rate, self.dbfs)
        if first is not None:
            self.at = max(arrived_s, self.first_byte_at + self._played_s + first / sample_rate)
        self._played_s += samples.size / sample_rate
