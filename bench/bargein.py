"""Voice barge-in as a person does it: talk over a reply and time how fast it stops.

Starts the real server (default configs/cpu.yaml: Silero VAD, Whisper, SmolLM2, Piper) and
a WebSocket client that streams a microphone in real time (20 ms binary PCM16 frames at
24 kHz: silence, and beckett.wav for the interrupting speech). The client asks for a long
spoken reply; 1 s after its first audio it starts talking. Measured from the first speech
sample sent (the clip is trimmed to its speech onset):

* onset -> ``input_audio_buffer.speech_started``: the client flushes its player here, so
  this is when the assistant stops talking for the listener (the design target is <= ~200 ms);
* onset -> ``response.done{status: cancelled}``;
* audio bytes of the cancelled response received after that done (must be 0).

    python bench/bargein.py [--config PATH] [--trials N] [--json PATH]

BARGEIN_TRACE=1 prints every server event after the onset with its time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import soundfile as sf
import soxr
import websockets
from serverproc import ROOT, running_server

RATE = 24000
FRAME = RATE // 50  # 20 ms


def speech_clip() -> bytes:
    """beckett.wav at 24 kHz PCM16, starting at its first speech (found by energy)."""
    data, rate = sf.read(ROOT / "tests" / "data" / "beckett.wav", dtype="float32")
    if data.ndim > 1:
        data = data.mean(axis=1)
    data = soxr.resample(data, rate, RATE)
    win = RATE // 100
    rms = np.sqrt(np.convolve(data**2, np.ones(win) / win, mode="same"))
    start = int(np.argmax(rms > 0.1 * rms.max()))
    data = data[max(0, start - win) : start + 3 * RATE]
    return (np.clip(data, -1, 1) * 32767).astype(np.int16).tobytes()


async def trial(addr: str, clip: bytes) -> dict[str, float | int]:
    silence = b"\0\0" * FRAME
    async with websockets.connect(f"ws://{addr}/v1/realtime", max_size=None) as ws:
        await ws.send(
            json.dumps(
                {
                    "type": "session.update",
                    "session": {
                        "output_modalities": ["audio"],
                        "audio": {"input": {"format": {"type": "audio/pcm", "rate": RATE}}},
                    },
                }
            )
        )
        await ws.send(
            json.dumps(
                {
                    "type": "conversation.item.create",
                    "item": {
                        "type": "message",
                        "role": "user",
                        "content": [
                            {
                                "type": "input_text",
                                "text": "Tell me a long story about a dragon who learns to sing.",
                            }
                        ],
                    },
                }
            )
        )
        await ws.send(json.dumps({"type": "response.create"}))
        marks: dict[str, float] = {}
        state = {"talking": False, "done": False, "after": 0}
        first_audio = asyncio.get_running_loop().create_future()
        onset_at: list[float] = []

        async def reader() -> None:
            async for raw in ws:
                if isinstance(raw, bytes):
                    continue
                ev = json.loads(raw)
                kind = ev["type"]
                now = time.perf_counter()
                if state["talking"] and os.environ.get("BARGEIN_TRACE"):
                    print(f"{(now - onset_at[0]) * 1000:8.1f} {kind}")
                if kind in ("response.output_audio.delta", "response.audio.delta"):
                    if not first_audio.done():
                        first_audio.set_result(now)
                    if state["done"]:
                        state["after"] += len(ev["delta"]) * 3 // 4
                elif kind == "input_audio_buffer.speech_started" and state["talking"]:
                    marks.setdefault("speech_started", now)
                elif kind == "response.done" and state["talking"]:
                    status = ev["response"]["status"]
                    marks.setdefault("done", now)
                    marks["cancelled"] = 1.0 if status == "cancelled" else 0.0
                    state["done"] = True
                    return

        task = asyncio.create_task(reader())
        t = time.perf_counter()
        while not first_audio.done():  # the microphone streams silence meanwhile
            await ws.send(silence)
            t += 0.02
            await asyncio.sleep(max(0.0, t - time.perf_counter()))
        t_first = first_audio.result()
        while time.perf_counter() < t_first + 1.0:
            await ws.send(silence)
            t += 0.02
            await asyncio.sleep(max(0.0, t - time.perf_counter()))
        onset = time.perf_counter()
        onset_at.append(onset)
        state["talking"] = True
        t = onset
        for i in range(0, len(clip), FRAME * 2):
            if task.done():
                break
            await ws.send(clip[i : i + FRAME * 2])
            t += 0.02
            await asyncio.sleep(max(0.0, t - time.perf_counter()))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(task, 5)
        await asyncio.sleep(0.5)  # anything late of the cancelled reply would show up now
        return {
            "onset_to_speech_started_ms": (marks.get("speech_started", float("nan")) - onset)
            * 1000,
            "onset_to_cancelled_done_ms": (marks.get("done", float("nan")) - onset) * 1000,
            "cancelled": int(marks.get("cancelled", 0.0)),
            "stale_bytes": int(state["after"]),
        }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    clip = speech_clip()
    rows = []
    with running_server(args.config) as (addr, _):
        for _ in range(args.trials):
            rows.append(await trial(addr, clip))
    ok = [r for r in rows if r["cancelled"]]
    p50 = statistics.median
    return {
        "config": str(args.config),
        "trials": len(rows),
        "cancelled": len(ok),
        "onset_to_speech_started_ms_p50": round(
            p50([r["onset_to_speech_started_ms"] for r in ok]), 1
        )
        if ok
        else None,
        "onset_to_cancelled_done_ms_p50": round(
            p50([r["onset_to_cancelled_done_ms"] for r in ok]), 1
        )
        if ok
        else None,
        "stale_bytes": sum(int(r["stale_bytes"]) for r in rows),
        "rows": rows,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "cpu.yaml")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    out = asyncio.run(main_async(args))
    print(
        f"{'trial':>5} {'onset->speech_started ms':>26} {'onset->done{cancelled} ms':>27} "
        f"{'stale bytes':>12}"
    )
    for i, r in enumerate(out["rows"]):
        print(
            f"{i:>5} {r['onset_to_speech_started_ms']:>26.1f} "
            f"{r['onset_to_cancelled_done_ms']:>27.1f} {r['stale_bytes']:>12}"
        )
    print(
        f"p50: speech_started {out['onset_to_speech_started_ms_p50']} ms, cancelled done "
        f"{out['onset_to_cancelled_done_ms_p50']} ms, {out['cancelled']}/{out['trials']} "
        f"cancelled, stale bytes {out['stale_bytes']}"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
