"""Per-stage figures of the embedded CPU stack (models called directly, one at a time).

    python bench/stages.py [--json PATH] [--repeat N]

VAD ms per 32 ms chunk; ASR latency and RTF on a short (synthesized question, ~1.7 s) and a
long clip (beckett.wav, 10 s); LLM time to first token and decode tok/s; TTS RTF and
first-chunk latency; peak RSS of the default stack (silero + whisper + llama.cpp + piper)
and with the alternatives (pocketsphinx, espeak) loaded too. Figures are medians of
``--repeat`` runs. The machine may be shared: run it when idle for numbers to quote.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import soundfile as sf

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from audio_kit.pcm import pcm16_to_float32
from audio_kit.vad import CHUNK_SAMPLES, SileroVad
from duplex_contract.batch import AudioOut, ChatMessage
from engine.messages import AsrRequest, TtsRequest
from engine.stages.asr_pocketsphinx import (
    PocketsphinxAsr,
    PocketsphinxOptions,
    PocketsphinxStream,
)
from engine.stages.asr_whisper import WhisperAsr, WhisperOptions
from engine.stages.llm_llamacpp import LlamaCppLlm, LlamaCppOptions
from engine.stages.tts_espeak import EspeakOptions, EspeakTts
from engine.stages.tts_piper import PiperOptions, PiperTts

BECKETT = Path(__file__).resolve().parent.parent / "tests" / "data" / "beckett.wav"
TTS_TEXT = (
    "Hello there. I am a small speech server running entirely on the CPU. "
    "Ask me anything and I will answer as quickly as I can."
)
GO = threading.Event()  # never set: nothing is cancelled here


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def median(values: list[float]) -> float:
    return float(statistics.median(values))


def bench_vad(pcm: bytes) -> dict[str, float]:
    load_s, vad = timed(SileroVad)
    audio = pcm16_to_float32(pcm)
    chunks = [
        audio[i : i + CHUNK_SAMPLES] for i in range(0, len(audio) - CHUNK_SAMPLES, CHUNK_SAMPLES)
    ]
    times = []
    for chunk in chunks * 3:
        start = time.perf_counter()
        vad.probability(chunk)
        times.append((time.perf_counter() - start) * 1000)
    return {
        "load_s": load_s,
        "ms_per_chunk": median(times),
        "p99_ms_per_chunk": float(np.percentile(times, 99)),
    }


def tts_pcm(tts: PiperTts | EspeakTts, text: str, rate: int) -> tuple[bytes, float, float]:
    """(pcm, first-chunk latency s, total s)."""
    start = time.perf_counter()
    first = 0.0
    parts: list[bytes] = []
    for out in tts.run(TtsRequest(request_id="b", text=text, sample_rate=rate), GO):
        if isinstance(out, AudioOut):
            if not parts:
                first = time.perf_counter() - start
            parts.append(out.pcm)
    return b"".join(parts), first, time.perf_counter() - start


def bench_tts(tts: PiperTts | EspeakTts, repeat: int) -> dict[str, float]:
    runs = [tts_pcm(tts, TTS_TEXT, 24000) for _ in range(repeat)]
    audio_s = len(runs[0][0]) / 2 / 24000
    clause = [tts_pcm(tts, "Ask me anything and I will answer quickly.", 24000) for _ in range(3)]
    return {
        "audio_s": audio_s,
        "synth_s": median([r[2] for r in runs]),
        "rtf": median([r[2] for r in runs]) / audio_s,
        "first_chunk_ms": median([r[1] for r in runs]) * 1000,
        "clause_first_chunk_ms": median([c[1] for c in clause]) * 1000,
    }


def asr_text(asr: WhisperAsr | PocketsphinxAsr, pcm: bytes) -> str:
    if isinstance(asr, WhisperAsr):
        return asr.transcribe(pcm16_to_float32(pcm), "en")
    out = next(iter(asr.run(AsrRequest(request_id="b", audio=pcm), GO)))
    return str(getattr(out, "text", ""))


def bench_asr(
    asr: WhisperAsr | PocketsphinxAsr, clips: dict[str, bytes], repeat: int
) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for name, pcm in clips.items():
        seconds = len(pcm) / 2 / 16000
        times, text = [], ""
        for _ in range(repeat):
            start = time.perf_counter()
            text = asr_text(asr, pcm)
            dt = time.perf_counter() - start
            times.append(dt)
        result[name] = {
            "audio_s": seconds,
            "latency_ms": median(times) * 1000,
            "rtf": median(times) / seconds,
            "text": text,
        }
    return result


def bench_ps_stream(pcm: bytes) -> dict[str, float]:
    stream = PocketsphinxStream()
    times = []
    for i in range(0, len(pcm), 640):
        start = time.perf_counter()
        stream.feed(pcm[i : i + 640])
        times.append((time.perf_counter() - start) * 1000)
    final_s, _ = timed(stream.finish)
    return {"ms_per_20ms_chunk": median(times), "finish_ms": final_s * 1000}


def bench_llm(llm: LlamaCppLlm, repeat: int) -> dict[str, float]:
    ttft, tps, n_tok = [], [], []
    for i in range(repeat):
        # A distinct system prompt each run: the whole prompt is evaluated (no KV reuse).
        system = ChatMessage(role="system", content=f"Session {i}. You are a helpful assistant.")
        user = ChatMessage(role="user", content="Tell me about the history of the bicycle.")
        start = time.perf_counter()
        first = 0.0
        count = 0
        for item in llm.generate((system, user), max_tokens=64, temperature=0.0, cancelled=None):
            if isinstance(item, str):
                if not first:
                    first = time.perf_counter()
            else:
                count = item[1]
        end = time.perf_counter()
        ttft.append(first - start)
        tps.append((count - 1) / (end - first) if count > 1 else 0.0)
        n_tok.append(count)
    # A follow-up turn: the history is a cached prefix, only the new turn is evaluated.
    history = (
        ChatMessage(role="system", content="You are a helpful assistant."),
        ChatMessage(role="user", content="Hi there."),
    )
    reply = "".join(
        x
        for x in llm.generate(history, max_tokens=32, temperature=0.0, cancelled=None)
        if isinstance(x, str)
    )
    follow = (
        *history,
        ChatMessage(role="assistant", content=reply),
        ChatMessage(role="user", content="Thanks, and you?"),
    )
    start = time.perf_counter()
    follow_ttft = 0.0
    for item in llm.generate(follow, max_tokens=8, temperature=0.0, cancelled=None):
        if isinstance(item, str):
            follow_ttft = time.perf_counter() - start
            break
    return {
        "ttft_ms": median(ttft) * 1000,
        "ttft_followup_ms": follow_ttft * 1000,
        "decode_tok_s": median(tps),
        "tokens": median([float(n) for n in n_tok]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the figures here as JSON")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    beckett, rate = sf.read(BECKETT, dtype="int16")
    assert rate == 16000
    beckett_pcm = bytes(beckett.tobytes())
    figures: dict[str, Any] = {"cpu_count": os.cpu_count(), "repeat": args.repeat}
    figures["rss_start_mb"] = peak_rss_mb()

    figures["vad_silero"] = bench_vad(beckett_pcm)
    load: dict[str, float] = {}
    whisper = WhisperAsr(WhisperOptions(), "asr")
    llm = LlamaCppLlm(LlamaCppOptions(), "llm")
    piper = PiperTts(PiperOptions(), "tts")
    for name, backend in (("whisper", whisper), ("llamacpp", llm), ("piper", piper)):
        load[name] = timed(backend.load)[0]
    question = tts_pcm(piper, "What is the weather like today?", 16000)[0]
    clips = {"short": question, "long": beckett_pcm}
    figures["tts_piper"] = bench_tts(piper, args.repeat)
    figures["asr_whisper"] = bench_asr(whisper, clips, args.repeat)
    figures["llm_llamacpp"] = bench_llm(llm, args.repeat)
    figures["rss_default_stack_mb"] = peak_rss_mb()

    pocketsphinx = PocketsphinxAsr(PocketsphinxOptions(), "asr-ps")
    espeak = EspeakTts(EspeakOptions(), "tts-espeak")
    load["pocketsphinx"] = timed(pocketsphinx.load)[0]
    load["espeak"] = timed(espeak.load)[0]
    figures["asr_pocketsphinx"] = bench_asr(pocketsphinx, clips, args.repeat)
    figures["asr_pocketsphinx"]["stream"] = bench_ps_stream(question)
    figures["tts_espeak"] = bench_tts(espeak, args.repeat)
    figures["load_s"] = load
    figures["rss_all_mb"] = peak_rss_mb()

    print_table(figures)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
        print(f"wrote {args.json}")
    return 0


def print_table(f: dict[str, Any]) -> None:
    rows: list[tuple[str, str, str]] = []
    v = f["vad_silero"]
    rows.append(
        (
            "VAD silero",
            "ms / 32 ms chunk",
            f"{v['ms_per_chunk']:.3f} (p99 {v['p99_ms_per_chunk']:.3f})",
        )
    )
    for key, label in (("asr_whisper", "ASR whisper"), ("asr_pocketsphinx", "ASR pocketsphinx")):
        for clip in ("short", "long"):
            a = f[key][clip]
            rows.append(
                (
                    label,
                    f"{clip} clip {a['audio_s']:.2f} s",
                    f"{a['latency_ms']:.0f} ms, RTF {a['rtf']:.3f}",
                )
            )
    s = f["asr_pocketsphinx"]["stream"]
    rows.append(
        (
            "ASR pocketsphinx",
            "stream",
            f"{s['ms_per_20ms_chunk']:.2f} ms / 20 ms, finish {s['finish_ms']:.0f} ms",
        )
    )
    m = f["llm_llamacpp"]
    rows.append(
        (
            "LLM llama.cpp",
            "TTFT fresh / follow-up",
            f"{m['ttft_ms']:.0f} ms / {m['ttft_followup_ms']:.0f} ms",
        )
    )
    rows.append(("LLM llama.cpp", "decode", f"{m['decode_tok_s']:.1f} tok/s"))
    for key, label in (("tts_piper", "TTS piper"), ("tts_espeak", "TTS espeak")):
        t = f[key]
        rows.append((label, f"RTF ({t['audio_s']:.1f} s audio)", f"{t['rtf']:.4f}"))
        rows.append(
            (
                label,
                "first chunk text / clause",
                f"{t['first_chunk_ms']:.0f} ms / {t['clause_first_chunk_ms']:.0f} ms",
            )
        )
    rows.append(
        (
            "stack",
            "peak RSS default / all",
            f"{f['rss_default_stack_mb']:.0f} MB / {f['rss_all_mb']:.0f} MB",
        )
    )
    rows.append(("stack", "load s", ", ".join(f"{k} {v:.2f}" for k, v in f["load_s"].items())))
    width = max(len(r[0]) for r in rows), max(len(r[1]) for r in rows)
    for a, b, c in rows:
        print(f"{a:<{width[0]}}  {b:<{width[1]}}  {c}")


if __name__ == "__main__":
    raise SystemExit(main())
