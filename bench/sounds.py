"""Sounds a listener makes over an answer (a hum, a cough, a laugh, a door), generated.

The project ships no recordings of them, so they are synthesized here, deterministically
(numpy only, one seed per variant), at 16 kHz PCM16 mono and speech level (RMS ~3000):

* **cough**: a sharp burst of breath noise (5 ms attack, ~120 ms decay) shaped by the
  vocal tract's first resonances (~500 and ~1600 Hz), with a short voiced tail (a glottal
  pulse train at ~140 Hz) as a throat closes; ``cough2`` is two of them.
* **laugh**: "ha-ha-ha-ha": four syllables at ~4.5 per second, each an aspiration
  (breath noise, 40 ms) then an open vowel /a/ (a glottal pulse train at a falling
  ~230-180 Hz through formants at 800, 1250 and 2600 Hz), the pitch and loudness falling
  from one syllable to the next as a laugh does. It is made of voice, so a voice detector
  may well call it speech: what the interruption rule has to refuse.
* **hum**: "mm-hm" with the mouth closed, as people say it: a nasal murmur (a glottal pulse
  train through a strong ~250 Hz resonance and faint ones at ~1000 and ~2200 Hz) for
  0.22 s at a level ~120 Hz, a 70 ms dip with a breath, then 0.28 s rising 112 -> 150 Hz.
  The TTS voices cannot hum: Whisper-base hears Piper's "Mm-hmm." as "in my mom." and
  eSpeak NG's "Mm-hm." as "Emma McCorme", words; it hears this hum as "" (or "I'm").
* **door**: a slam: a broadband click, a low body resonance (~90 Hz, 350 ms decay) and a
  rattle of short noise bursts.

The shaping is done in the frequency domain (the excitation's spectrum times a sum of
resonance curves), so no filter library is needed. ``python bench/sounds.py DIR`` writes
them as WAV files to listen to.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import numpy.typing as npt

RATE = 16000
LEVEL_RMS = 3000.0

Float = npt.NDArray[np.float64]


def _shape(x: Float, formants: list[tuple[float, float, float]]) -> Float:
    """``x`` through resonances ``(centre Hz, bandwidth Hz, gain)`` (zero-phase, by FFT)."""
    n = 1 << int(np.ceil(np.log2(max(x.size, 2))))
    spec = np.fft.rfft(x, n)
    f = np.fft.rfftfreq(n, 1 / RATE)
    resp = np.zeros_like(f)
    for centre, width, gain in formants:
        resp += gain / (1.0 + ((f - centre) / (width / 2)) ** 2)
    return np.fft.irfft(spec * resp, n)[: x.size]


def _pulses(duration_s: float, f0_start: float, f0_end: float, rng: np.random.Generator) -> Float:
    """A glottal pulse train whose pitch glides from ``f0_start`` to ``f0_end`` (a little
    jitter), as a speaking voice's excitation."""
    n = int(duration_s * RATE)
    f0 = np.linspace(f0_start, f0_end, n) * (1 + 0.01 * rng.standard_normal(n))
    phase = np.cumsum(f0 / RATE)
    saw = phase - np.floor(phase)
    return np.exp(-saw * 12.0) - np.exp(-12.0) / 2  # a sharp rise, decaying pulse


def _envelope(n: int, attack_s: float, decay_s: float) -> Float:
    t = np.arange(n) / RATE
    return np.minimum(1.0, t / max(attack_s, 1e-4)) * np.exp(
        -np.maximum(0.0, t - attack_s) / decay_s
    )


def _level(x: Float, pad_s: float = 0.05) -> bytes:
    """Normalized to :data:`LEVEL_RMS` over its loud part, padded with ``pad_s`` silence."""
    loud = x[np.abs(x) > 0.05 * np.max(np.abs(x))]
    x = x / (np.sqrt(np.mean(loud**2)) + 1e-9) * LEVEL_RMS
    pad = np.zeros(int(pad_s * RATE))
    out = np.concatenate((pad, x, pad))
    return bytes(np.clip(out, -32768, 32767).astype("<i2").tobytes())


def cough(seed: int = 1) -> Float:
    rng = np.random.default_rng(seed)
    n = int(0.28 * RATE)
    burst = _shape(rng.standard_normal(n), [(500, 400, 1.0), (1600, 700, 0.8), (3000, 1500, 0.3)])
    burst *= _envelope(n, 0.005, 0.12)
    tail = _shape(_pulses(0.1, 150, 120, rng), [(600, 200, 1.0), (1400, 300, 0.5)])
    tail *= _envelope(tail.size, 0.01, 0.04) * 0.3
    out = np.zeros(n + tail.size // 2)
    out[:n] += burst
    out[n - tail.size // 2 :] += tail
    return out


def laugh(seed: int = 2, syllables: int = 4) -> Float:
    rng = np.random.default_rng(seed)
    parts: list[Float] = []
    for i in range(syllables):
        f0 = 230.0 - 15.0 * i
        breath = _shape(rng.standard_normal(int(0.04 * RATE)), [(1200, 2000, 0.4)])
        vowel = _shape(
            _pulses(0.12, f0, f0 - 20, rng) + 0.05 * rng.standard_normal(int(0.12 * RATE)),
            [(800, 130, 1.0), (1250, 150, 0.7), (2600, 250, 0.25)],
        )
        vowel *= np.hanning(vowel.size) ** 0.5
        gap = np.zeros(int(0.06 * RATE))
        parts += [breath * 0.5, vowel * (0.85**i), gap]
    return np.concatenate(parts)


def hum(seed: int = 5) -> Float:
    rng = np.random.default_rng(seed)
    nasal = [(250, 100, 1.0), (1000, 250, 0.12), (2200, 400, 0.05)]
    mm = _shape(_pulses(0.22, 125, 118, rng), nasal) * np.hanning(int(0.22 * RATE)) ** 0.3
    breath = _shape(rng.standard_normal(int(0.03 * RATE)), [(1500, 2500, 0.2)]) * 0.3
    hm = _shape(_pulses(0.28, 112, 150, rng), nasal) * np.hanning(int(0.28 * RATE)) ** 0.3
    return np.concatenate((mm, np.zeros(int(0.07 * RATE)), breath, hm))


def door(seed: int = 3) -> Float:
    rng = np.random.default_rng(seed)
    n = int(0.5 * RATE)
    t = np.arange(n) / RATE
    click = np.zeros(n)
    click[:40] = rng.standard_normal(40) * np.linspace(1, 0, 40) * 4
    body = np.sin(2 * np.pi * 90 * t) * np.exp(-t / 0.35) + 0.4 * np.sin(
        2 * np.pi * 210 * t
    ) * np.exp(-t / 0.1)
    rattle = np.zeros(n)
    for k in range(5):
        at = int((0.03 + 0.035 * k) * RATE)
        m = int(0.008 * RATE)
        rattle[at : at + m] += rng.standard_normal(m) * 0.6 * 0.7**k
    return click + body + rattle


#: name -> PCM16 16 kHz mono bytes
def sounds() -> dict[str, bytes]:
    two = np.concatenate((cough(1), np.zeros(int(0.12 * RATE)), cough(4)))
    return {
        "hum": _level(hum(5)),
        "cough": _level(cough(1)),
        "cough2": _level(two),
        "laugh": _level(laugh(2)),
        "door": _level(door(3)),
    }


def main() -> int:
    import wave

    out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    out.mkdir(parents=True, exist_ok=True)
    for name, pcm in sounds().items():
        with wave.open(str(out / f"{name}.wav"), "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(RATE)
            w.writeframes(pcm)
        print(out / f"{name}.wav", f"{len(pcm) / 2 / RATE:.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
