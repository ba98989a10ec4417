"""Time to first audio (TTFA) of a spoken turn: streaming pipeline vs a naive cascade.

Both run in the same process on the same models (configs/cpu.yaml by default). TTFA is
measured from the commit (the VAD's end of speech) to the first audio byte out of the engine.

* streaming: the user audio is appended in real time (20 ms chunks, as a microphone
  would; live partial transcripts run meanwhile); when the pause begins the engine starts ASR
  speculatively (``input.pause``); after the silence window the turn is committed; LLM
  tokens stream into the segmenter and TTS starts on the first clause.
* naive: after the same silence window, full ASR, then the full LLM reply, then TTS of the
  whole reply; its first audio byte exists when that synthesis returns.

    python bench/turn_latency.py [--quick] [--config PATH] [--silence-ms 500] [--json PATH]

JSON keys: ttfa_ms_p50, naive_ttfa_ms_p50, ttfa_ratio (+ per-turn rows).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

from duplex_contract.audible import AudibleStart
from duplex_contract.batch import (
    AudioOut,
    ChatJob,
    ChatMessage,
    SpeechJob,
    TextOut,
    TranscribeJob,
    TranscriptOut,
)
from duplex_contract.control import AppendCall, CloseCall, CommitCall, OpenCall, SignalCall
from duplex_contract.session_events import AudioChunk, ResponseDone, UserTranscript
from duplex_contract.settings import SessionSettings
from engine.api.client import AsyncEngine
from engine.config import load_engine_config

ROOT = Path(__file__).resolve().parents[1]
TURNS = [
    "What is the weather like today?",
    "Can you tell me a short joke?",
    "How far away is the moon?",
    "What should I cook for dinner tonight?",
    "Tell me something interesting about cats.",
]
CHUNK = 640  # 20 ms at 16 kHz, PCM16


async def record(engine: AsyncEngine, text: str) -> bytes:
    """The user's turn: the TTS stage speaks it at 16 kHz (a stand-in microphone)."""
    pcm = bytearray()
    async for item in engine.generate(SpeechJob(text=text, sample_rate=16000)):
        if isinstance(item, AudioOut):
            pcm += item.pcm
    return bytes(pcm)


async def streaming_turn(engine: AsyncEngine, audio: bytes, silence_s: float) -> dict[str, object]:
    res = await engine.call(OpenCall(config=SessionSettings(output_modalities=("audio",))))
    assert res.session_id and res.accepted_fence
    sid, fence, gen = res.session_id, res.accepted_fence, res.lease_generation
    t = time.perf_counter()
    for i in range(0, len(audio), CHUNK):  # a microphone: 20 ms chunks in real time
        await engine.call(AppendCall(fence=fence, lease_generation=gen, audio=audio[i : i + CHUNK]))
        t += 0.02
        await asyncio.sleep(max(0.0, t - time.perf_counter()))
    # the VAD saw the pause begin
    await engine.call(SignalCall(fence=fence, lease_generation=gen, event="input.pause"))
    silence = b"\0\0" * int(16000 * silence_s)
    await asyncio.sleep(silence_s)  # the silence window passes in real time
    await engine.call(AppendCall(fence=fence, lease_generation=gen, audio=silence))
    t0 = time.perf_counter()
    fence = (
        await engine.call(CommitCall(fence=fence, lease_generation=gen))
    ).accepted_fence or fence
    ttfa = None
    transcript = ""
    heard_ms = float("nan")
    audible = AudibleStart()
    async for ev in engine.session_events(sid):
        if isinstance(ev, UserTranscript) and ev.final:
            transcript = ev.text
            heard_ms = (time.perf_counter() - t0) * 1000
        elif isinstance(ev, AudioChunk):
            if ttfa is None:
                ttfa = (time.perf_counter() - t0) * 1000
            audible.feed(time.perf_counter(), ev.pcm, ev.sample_rate)
        elif isinstance(ev, ResponseDone):
            reply, total = ev.text, (time.perf_counter() - t0) * 1000
            break
    await engine.call(CloseCall(fence=fence, lease_generation=gen))
    return {
        "ttfa_ms": ttfa,
        # the first audible sample (-40 dBFS) as a player starting at the first byte hears it
        "audible_ms": None if audible.at is None else (audible.at - t0) * 1000,
        "transcript_ms": heard_ms,  # commit -> final user transcript (0 if speculation won)
        "total_ms": total,
        "transcript": transcript,
        "reply": reply,
    }


async def naive_turn(engine: AsyncEngine, audio: bytes, silence_s: float) -> dict[str, object]:
    await asyncio.sleep(silence_s)  # the same end-of-speech rule
    t0 = time.perf_counter()
    padded = audio + b"\0\0" * int(16000 * silence_s)
    transcript = ""
    async for item in engine.generate(TranscribeJob(audio=padded)):
        if isinstance(item, TranscriptOut):
            transcript = item.text
    t_asr = time.perf_counter()
    reply = ""
    async for item in engine.generate(
        ChatJob(
            messages=(
                ChatMessage("system", engine.config.default_instructions),
                ChatMessage("user", transcript),
            ),
            max_tokens=engine.config.max_output_tokens,
        )
    ):
        if isinstance(item, TextOut):
            reply += item.text
    t_llm = time.perf_counter()
    n = 0
    async for item in engine.generate(SpeechJob(text=reply, sample_rate=24000)):
        if isinstance(item, AudioOut):
            n += len(item.pcm)
    t_end = time.perf_counter()
    return {
        "ttfa_ms": (t_end - t0) * 1000,
        "asr_ms": (t_asr - t0) * 1000,
        "llm_ms": (t_llm - t_asr) * 1000,
        "tts_ms": (t_end - t_llm) * 1000,
        "transcript": transcript,
        "reply": reply,
    }


async def main_async(args: argparse.Namespace) -> dict[str, object]:
    cfg = load_engine_config(args.config)
    t = time.perf_counter()
    engine = await AsyncEngine.start(cfg)
    load_s = time.perf_counter() - t
    rows: list[dict[str, object]] = []
    try:
        clips = [await record(engine, text) for text in TURNS]
        reps = 1 if args.quick else 3
        for rep in range(reps):
            for text, clip in zip(TURNS, clips, strict=True):
                s = await streaming_turn(engine, clip, args.silence_ms / 1000)
                n = await naive_turn(engine, clip, args.silence_ms / 1000)
                rows.append({"turn": text, "rep": rep, "streaming": s, "naive": n})
    finally:
        await engine.shutdown()
    ttfa = [float(r["streaming"]["ttfa_ms"]) for r in rows]  # type: ignore[index]
    audible = [
        float(r["streaming"]["audible_ms"])  # type: ignore[index]
        for r in rows
        if r["streaming"]["audible_ms"] is not None  # type: ignore[index]
    ]
    naive = [float(r["naive"]["ttfa_ms"]) for r in rows]  # type: ignore[index]
    p50, n50 = statistics.median(ttfa), statistics.median(naive)
    return {
        "config": str(args.config),
        "engine_start_s": round(load_s, 2),
        "silence_ms": args.silence_ms,
        "ttfa_ms_p50": round(p50, 1),
        "audible_ms_p50": round(statistics.median(audible), 1) if audible else None,
        "naive_ttfa_ms_p50": round(n50, 1),
        "ttfa_ratio": round(p50 / n50, 3),
        "ttfa_ms_max": round(max(ttfa), 1),
        "rows": rows,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "cpu.yaml")
    ap.add_argument("--quick", action="store_true", help="one pass over the 5 turns (else 3)")
    ap.add_argument("--silence-ms", type=float, default=500.0, help="VAD silence window")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    out = asyncio.run(main_async(args))
    print(f"{'turn':<42} {'TTFA ms':>9} {'ASR ms':>7} {'naive ms':>9}  heard / reply")
    for r in out["rows"]:  # type: ignore[attr-defined]
        s, n = r["streaming"], r["naive"]
        print(
            f"{r['turn']:<42} {s['ttfa_ms']:>9.0f} {n['ttfa_ms']:>9.0f}  "
            f"{s['transcript']!r} -> {str(s['reply'])[:60]!r}"
        )
    print(
        f"\nTTFA p50 {out['ttfa_ms_p50']} ms (first audible {out['audible_ms_p50']} ms) | "
        f"naive p50 {out['naive_ttfa_ms_p50']} ms | "
        f"ratio {out['ttfa_ratio']} (target <= 0.25) | engine start {out['engine_start_s']} s"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
