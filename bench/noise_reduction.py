"""Input noise reduction (``audio.input.noise_reduction``, audio_kit/denoise.py): what it costs
and what it does to the VAD and the ASR.

    python bench/noise_reduction.py [--json PATH] [--snr DB]

tests/data/beckett.wav (a real recording, six phrases) with 2 s of noise before and after,
mixed with pink noise plus a 120 Hz hum at ``--snr`` dB (speech power over its phrases vs the
noise). For no reduction, ``near_field`` and ``far_field``: Silero VAD false triggers
(speech_started outside the phrases, server VAD defaults, through the server's own
InputProcessor), Whisper WER of the noisy mix and of the clean recording, and the CPU time of
the suppressor per second of session audio. The machine may be shared: the load is printed
with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import soundfile as sf

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

RATE = 16000
PAD_S = 2.0
#: the phrases of beckett.wav (tests/data/README.md), seconds
PHRASES = ((0.35, 1.22), (1.89, 2.82), (3.52, 4.19), (4.90, 5.60), (6.66, 7.39), (8.16, 8.90))
REFERENCE = "Ever tried. Ever failed. No matter. Try again. Fail again. Fail better."
KINDS: tuple[str | None, ...] = (None, "near_field", "far_field")


def beckett() -> np.ndarray:
    audio, rate = sf.read(Path(__file__).resolve().parent.parent / "tests/data/beckett.wav")
    assert rate == RATE
    return np.asarray(audio, dtype=np.float64)


def noise(n: int, seed: int = 7) -> np.ndarray:
    """Pink noise (1/f power) plus a 120 Hz hum: a fan and mains in a room."""
    rng = np.random.default_rng(seed)
    spectrum = np.fft.rfft(rng.standard_normal(n))
    freqs = np.fft.rfftfreq(n, 1 / RATE)
    spectrum[1:] /= np.sqrt(freqs[1:])
    spectrum[0] = 0
    pink = np.fft.irfft(spectrum, n)
    pink /= np.sqrt(np.mean(pink**2))
    hum = np.sin(2 * np.pi * 120 * np.arange(n) / RATE) * 0.5
    return pink + hum


def padded(speech: np.ndarray) -> np.ndarray:
    pad = np.zeros(int(PAD_S * RATE))
    return np.concatenate([pad, speech, pad])


def mix(speech: np.ndarray, snr_db: float) -> np.ndarray:
    """``speech`` padded with 2 s on each side, plus noise at ``snr_db`` (PCM16 range)."""
    clean = padded(speech)
    spoken = np.concatenate([speech[int(a * RATE) : int(b * RATE)] for a, b in PHRASES])
    p_speech = float(np.mean(spoken**2))
    n = noise(len(clean))
    n *= np.sqrt(p_speech / (10 ** (snr_db / 10)) / np.mean(n**2))
    return clean + n


def pcm16(x: np.ndarray) -> bytes:
    return bytes((np.clip(x, -1, 1) * 32767).astype("<i2").tobytes())


def process(pcm: bytes, kind: str | None, vad: str = "silero") -> tuple[bytes, list[float], float]:
    """Through the server's input processor (16 kHz in, Silero VAD): (audio after noise
    reduction, speech onsets in s, seconds spent in the suppressor)."""
    from duplex_server.protocol.codec import PCM16_16K
    from duplex_server.protocol.events import TurnDetection
    from duplex_server.protocol.vad_events import VadStart
    from duplex_server.session.input_processor import InputProcessor

    proc = InputProcessor(PCM16_16K, TurnDetection(), vad, kind)  # type: ignore[arg-type]
    spent = 0.0
    if proc._denoise is not None:  # time the suppressor alone on a copy of the input
        from audio_kit.denoise import NoiseSuppressor

        twin = NoiseSuppressor(proc._denoise.kind)
        t0 = time.process_time()
        for i in range(0, len(pcm), 640):
            twin.process(pcm[i : i + 640])
        spent = time.process_time() - t0
    out: list[bytes] = []
    onsets: list[float] = []
    for i in range(0, len(pcm), 640):  # 20 ms appends, as a client sends them
        audio, events = proc.process(pcm[i : i + 640], 0.0)
        out.append(audio)
        onsets += [e.audio_start_ms / 1000 for e in events if isinstance(e, VadStart)]
    return b"".join(out), onsets, spent


def false_triggers(onsets: list[float], margin_s: float = 0.35) -> int:
    """Onsets (of the padded audio) not near any phrase."""
    spans = [(a + PAD_S - margin_s, b + PAD_S + margin_s) for a, b in PHRASES]
    return sum(1 for t in onsets if not any(a <= t <= b for a, b in spans))


def words(text: str) -> list[str]:
    return "".join(c.lower() if c.isalnum() or c.isspace() else " " for c in text).split()


def wer(reference: str, hypothesis: str) -> float:
    ref, hyp = words(reference), words(hypothesis)
    prev = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        cur = [i] + [0] * len(hyp)
        for j, h in enumerate(hyp, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (r != h))
        prev = cur
    return prev[-1] / len(ref)


def measure(
    transcribe: Any, snr_db: float, kinds: tuple[str | None, ...] = KINDS
) -> dict[str, Any]:
    """Figures for each kind; ``transcribe(pcm16 16 kHz bytes) -> text``. VAD figures for
    both server VAD backends (Silero and the energy level)."""
    speech = beckett()
    noisy, clean = pcm16(mix(speech, snr_db)), pcm16(padded(speech))
    seconds = len(noisy) / 2 / RATE
    out: dict[str, Any] = {"snr_db": snr_db, "audio_s": seconds, "phrases": len(PHRASES)}
    for kind in kinds:
        row: dict[str, Any] = {}
        for vad in ("silero", "energy"):
            n_audio, n_onsets, spent = process(noisy, kind, vad)
            _, c_onsets, _ = process(clean, kind, vad)
            row[vad] = {
                "noisy_onsets": len(n_onsets),
                "noisy_false_triggers": false_triggers(n_onsets),
                "clean_onsets": len(c_onsets),
                "clean_false_triggers": false_triggers(c_onsets),
            }
        c_audio = process(clean, kind)[0]
        row["noisy_wer"] = round(wer(REFERENCE, transcribe(n_audio)), 3)
        row["clean_wer"] = round(wer(REFERENCE, transcribe(c_audio)), 3)
        row["cpu_ms_per_session_s"] = round(spent * 1000 / seconds, 3)
        out[kind or "off"] = row
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--snr", type=float, default=5.0)
    args = parser.parse_args()
    from faster_whisper import WhisperModel

    from engine.models import whisper_base_dir

    model = WhisperModel(str(whisper_base_dir()), device="cpu", compute_type="int8", cpu_threads=2)

    def transcribe(pcm: bytes) -> str:
        audio = np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0
        segments, _ = model.transcribe(audio, language="en", beam_size=1)
        return " ".join(s.text for s in segments)

    figures = measure(transcribe, args.snr)
    figures["load"] = os.getloadavg()
    print(json.dumps(figures, indent=2))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
