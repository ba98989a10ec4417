"""The sounds bench/turn_taking.py lays over live answers, and where their voice is.

* **Real interruptions** (with their words, for the WER of the turn that follows): the human
  recordings the project ships (tests/data/beckett.wav: "Ever tried.", "Ever failed.", "No
  matter.", "Try again.", "Fail again.", "Fail better."; tests/data/two_cities.wav: "It was
  the best of times.", "It was the age of wisdom."), and "Wait.", "No, stop.", "Hold on.",
  "Wait, what did you say?" and "Sorry, can I ask something?" spoken by the project's two
  TTS voices (Piper's, through the server's ``/v1/audio/speech``, and eSpeak NG's, through
  the engine's stage in this process).
* **Backchannels**: "Mm-hmm.", "Yeah.", "Okay.", "Right." in both voices.
* **Generated**: a hummed "mm-hm" (the TTS voices say words for it), a cough, a laugh and a
  door (bench/sounds.py says how).

Every clip is 16 kHz float32 mono with its first and last voiced sample (10 ms RMS over 5 %
of its loudest), so a bench can time its onset and its end as they are sent.
"""

from __future__ import annotations

import io
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import httpx
import numpy as np
import soundfile as sf
import soxr
from sounds import sounds

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
RATE = 16000

Kind = Literal["interrupt", "backchannel"]

#: (file, start s, end s, words): human recordings
HUMAN = [
    ("beckett.wav", 0.25, 1.35, "Ever tried."),
    ("beckett.wav", 1.75, 3.00, "Ever failed."),
    ("beckett.wav", 3.35, 4.35, "No matter."),
    ("beckett.wav", 4.80, 5.75, "Try again."),
    ("beckett.wav", 6.55, 7.55, "Fail again."),
    ("beckett.wav", 8.05, 9.05, "Fail better."),
    ("two_cities.wav", 0.35, 2.25, "It was the best of times."),
    ("two_cities.wav", 4.45, 5.80, "It was the age of wisdom."),
]
SPOKEN_INTERRUPTIONS = [
    "Wait.",
    "No, stop.",
    "Hold on.",
    "Wait, what did you say?",
    "Sorry, can I ask something?",
]
#: backchannel kind -> its text
BACKCHANNELS = {"mm-hm": "Mm-hmm.", "yeah": "Yeah.", "okay": "Okay.", "right": "Right."}
NOISES = ("hum", "cough", "laugh", "door")
#: the question whose answer the sounds are laid over (spoken on a phone call)
QUESTION = "Tell me a long story about a dragon who learns to sing."


@dataclass(frozen=True)
class Clip:
    name: str
    kind: Kind
    group: str  # the backchannel kind (mm-hm, ..., cough, laugh, door) or "interrupt"
    audio: np.ndarray  # float32, 16 kHz
    words: str  # what it says ("" for a noise)
    first: int  # first voiced sample
    last: int  # last voiced sample

    def pcm(self, rate: int) -> bytes:
        """PCM16 at ``rate``."""
        x = self.audio if rate == RATE else soxr.resample(self.audio, RATE, rate)
        return bytes((np.clip(x, -1, 1) * 32767).astype("<i2").tobytes())

    def at(self, rate: int, sample: int) -> int:
        """``sample`` (16 kHz) as a byte offset into :meth:`pcm` at ``rate``."""
        return 2 * int(sample * rate / RATE)


def _voiced(x: np.ndarray) -> tuple[int, int]:
    win = RATE // 100
    rms = np.sqrt(np.convolve(x.astype(np.float64) ** 2, np.ones(win) / win, mode="same"))
    idx = np.nonzero(rms > 0.05 * rms.max())[0]
    return int(idx[0]), int(idx[-1])


def _clip(name: str, kind: Kind, group: str, x: np.ndarray, words: str) -> Clip:
    x = x.astype(np.float32)
    first, last = _voiced(x)
    return Clip(name, kind, group, x, words, first, last)


def _level(x: np.ndarray, rms: float = 0.1) -> np.ndarray:
    """At a speaking level (the loud part's RMS): clips of every source alike."""
    loud = x[np.abs(x) > 0.05 * np.max(np.abs(x))]
    return x / (np.sqrt(np.mean(loud**2)) + 1e-9) * rms


def piper(addr: str, text: str, speed: float = 1.0) -> np.ndarray:
    """``text`` in the server's voice (Piper on the CPU default), 16 kHz."""
    body = {"model": "tts", "input": text, "response_format": "wav", "speed": speed}
    r = httpx.post(f"http://{addr}/v1/audio/speech", json=body, timeout=60)
    r.raise_for_status()
    x, rate = sf.read(io.BytesIO(r.content), dtype="float32")
    return np.asarray(soxr.resample(x, rate, RATE), dtype=np.float32)


def espeak(texts: list[str]) -> dict[str, np.ndarray]:
    """Each text in eSpeak NG's default voice (the engine's stage, in this process)."""
    sys.path.insert(0, str(ROOT))
    from engine.stages.tts_espeak import EspeakOptions, EspeakTts

    tts = EspeakTts(EspeakOptions(), "bench-espeak")
    tts.load()
    out = {}
    for text in texts:
        pcm = tts.synthesize(text, speed=1.0, keep_going=lambda: True)
        x = np.frombuffer(pcm, "<i2").astype(np.float32) / 32768.0
        out[text] = np.asarray(soxr.resample(x, tts.native_rate, RATE), dtype=np.float32)
    return out


def clips(addr: str) -> list[Clip]:
    """Every sound of the bench (the spoken ones rendered by the server at ``addr``)."""
    out: list[Clip] = []
    for file, start, end, words in HUMAN:
        x, rate = sf.read(DATA / file, dtype="float32")
        out.append(
            _clip(
                f"human:{words}",
                "interrupt",
                "interrupt",
                x[int(start * rate) : int(end * rate)],
                words,
            )
        )
    texts = SPOKEN_INTERRUPTIONS + list(BACKCHANNELS.values())
    voices = {"espeak": espeak(texts), "piper": {t: piper(addr, t) for t in texts}}
    pad = np.zeros(int(0.05 * RATE), dtype=np.float32)
    for voice, rendered in voices.items():
        for text in SPOKEN_INTERRUPTIONS:
            x = np.concatenate((pad, _level(rendered[text]), pad))
            out.append(_clip(f"{voice}:{text}", "interrupt", "interrupt", x, text))
        for group, text in BACKCHANNELS.items():
            x = np.concatenate((pad, _level(rendered[text]), pad))
            out.append(_clip(f"{voice}:{text}", "backchannel", group, x, text))
    for name, pcm in sounds().items():
        group = name.rstrip("0123456789")
        x = np.frombuffer(pcm, "<i2").astype(np.float32) / 32768.0
        out.append(_clip(f"generated:{name}", "backchannel", group, x, ""))
    return out


def question(addr: str, rate: int) -> bytes:
    """:data:`QUESTION` in the server's voice as PCM16 at ``rate`` (a caller's question)."""
    x = _level(piper(addr, QUESTION))
    x = x if rate == RATE else soxr.resample(x, RATE, rate)
    return bytes((np.clip(x, -1, 1) * 32767).astype("<i2").tobytes())
