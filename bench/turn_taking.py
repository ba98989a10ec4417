"""Turn-taking over live answers: real interruptions, backchannels and noises, and echo
alone, laid over the CPU default's spoken answers on each transport, with and without echo.

Starts the real server (default configs/cpu.yaml: Silero VAD, Whisper, SmolLM2, Piper, live
partials by pocketsphinx) and, one session at a time, gets a long spoken answer going and
says a clip over it at a random offset (0.8-2.5 s into the answer's audio), on the
WebSocket (the client plays; it opts in to ``interrupt_mode: confirm``), WebRTC (aiortc) and
a Twilio call (the tests' Twilio peer: plays at real time, echoes marks as it plays); the
media transports run the server's default (``auto``: ``confirm``). The clips
(bench/turn_taking_clips.py): human recordings the project ships and "wait", "no, stop",
... in its two TTS voices (real interruptions), "mm-hmm", "yeah", "okay", "right" in both
voices and a generated hum ("mm-hm"), cough, laugh and door (bench/sounds.py). With echo (WebRTC and
Twilio: the server hears the far end's playout there; over a WebSocket echo is the client's
own business), the answer is fed back into the far end's microphone at -6 to -20 dB, 40-200
ms late, with line noise; ``echo_only`` cells say nothing over it.

Cells per transport (``--trials`` each): ``interrupt``, ``backchannel`` and, on WebRTC and
Twilio, ``interrupt_echo``, ``backchannel_echo``, ``echo_only``. Figures, overall and per
transport (under ``transports``):

* ``interruptions_caught_pct``: real interruptions that ended the answer;
* ``heard_stop_ms_p50``: their speech onset -> the answer's audio stops for the listener
  (bench/turn_taking_ends.py: the pause or clear a WebSocket client is sent, the WebRTC
  track going silent, Twilio's ``clear``);
* ``backchannel_cut_pct``: backchannels and noises that ended the answer (and per kind);
* ``false_cut_resumed_pct``: of those the server paused for, the answer resumed from where it
  stopped within 1 s of the sound's end;
* ``echo_bargeins``: echo-only trials in which the answer paused or stopped, at any time
  from its first audio (goal 0);
* ``trials``: judged trials (a trial whose answer was over before the sound is void and
  retried); and the WER of the turn after a real interruption (WebSocket, WebRTC) against
  the batch route's on the same clips.

    python bench/turn_taking.py [--config PATH] [--transports websocket,webrtc,twilio]
        [--trials 20] [--seed 1] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import IO, Any

import httpx
import jiwer
import soundfile as sf
from probe import probe_ms
from serverproc import ROOT, running_server
from turn_taking_clips import Clip, clips, question
from turn_taking_ends import Echo, Outcome, twilio, webrtc, websocket

TRANSPORTS = ("websocket", "webrtc", "twilio")
MEDIA = ("webrtc", "twilio")
RESUME_WITHIN_MS = 1000.0
MAX_VOID = 10  # retries per cell of trials that could not be judged


def cells(transport: str) -> list[str]:
    base = ["interrupt", "backchannel"]
    if transport in MEDIA:
        base += ["interrupt_echo", "backchannel_echo", "echo_only"]
    return base


def norm(text: str) -> str:
    keep = "".join(c.lower() if c.isalnum() or c == "'" else " " for c in text)
    return " ".join(keep.split())


def wer(ref: str, hyp: str) -> float:
    return float(jiwer.wer(norm(ref), norm(hyp) or "<empty>"))


async def batch_words(addr: str, clip: Clip) -> str:
    buf = io.BytesIO()
    sf.write(buf, clip.audio, 16000, format="WAV", subtype="PCM_16")
    async with httpx.AsyncClient(timeout=60) as http:
        r = await http.post(
            f"http://{addr}/v1/audio/transcriptions",
            files={"file": ("clip.wav", buf.getvalue(), "audio/wav")},
            data={"model": "whisper"},
        )
        r.raise_for_status()
        return str(r.json()["text"])


async def trial(
    addr: str, transport: str, clip: Clip | None, offset: float, echo: Echo | None, q: bytes
) -> Outcome:
    if transport == "websocket":
        return await websocket(addr, clip, offset, echo)
    if transport == "webrtc":
        return await webrtc(addr, clip, offset, echo)
    return await twilio(addr, clip, offset, echo, q)


async def run_cell(
    addr: str,
    transport: str,
    cell: str,
    pool: list[Clip],
    n: int,
    rng: random.Random,
    q: bytes,
    args_trace: bool = False,
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    order = [pool[i % len(pool)] for i in range(n)] if pool else [None] * n  # type: ignore[list-item]
    rng.shuffle(order)
    voids = 0
    i = 0
    while i < len(order):
        clip = order[i]
        offset = rng.uniform(0.8, 2.5)
        echo = None
        if cell.endswith("echo") or cell == "echo_only":
            echo = Echo(rng.uniform(40, 200), rng.uniform(-20, -6))
        try:
            out = await asyncio.wait_for(trial(addr, transport, clip, offset, echo, q), 90)
        except (TimeoutError, OSError) as exc:
            out = Outcome(void=f"{type(exc).__name__}: {exc}"[:120])
        row = {
            "transport": transport,
            "cell": cell,
            "clip": None if clip is None else clip.name,
            "group": "echo" if clip is None else clip.group,
            "words": None if clip is None else clip.words,
            "offset_s": round(offset, 2),
            "echo": None if echo is None else [round(echo.delay_ms), round(echo.gain_db, 1)],
            **out.row(),
        }
        flag = "void: " + out.void if out.void else ""
        resumed = row["resume_after_end_ms"]
        print(
            f"{transport:9} {cell:16} {row['clip'] or '-':34} stop={row['heard_stop_ms']!s:>7} "
            f"paused={out.paused!s:5} ended={out.ended!s:5} resumed={resumed!s:>7} "
            f"{(out.transcript or '')[:30]!r} {flag}",
            flush=True,
        )
        if args_trace and out.events:
            print("    " + "\n    ".join(out.events), flush=True)
        if out.void and voids < MAX_VOID:
            voids += 1
            order.append(clip)  # the same sound again, later
            i += 1
            continue
        rows.append(row)
        i += 1
    return rows


def _pct(num: int, den: int) -> float | None:
    return None if den == 0 else round(100.0 * num / den, 1)


def _p50(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 1) if xs else None


def summarize(rows: list[dict[str, Any]], batch: dict[str, str]) -> dict[str, Any]:
    judged = [r for r in rows if not r["void"]]
    inter = [r for r in judged if r["cell"].startswith("interrupt")]
    bc = [r for r in judged if r["cell"].startswith("backchannel")]
    paused_bc = [r for r in bc if r["paused"]]
    quick = [
        r
        for r in paused_bc
        if r["resumed"]
        and r["resume_after_end_ms"] is not None
        and r["resume_after_end_ms"] <= RESUME_WITHIN_MS
    ]
    echo = [r for r in judged if r["cell"] == "echo_only"]
    stops = [r["heard_stop_ms"] for r in inter if r["heard_stop_ms"] is not None and r["ended"]]
    turns = [r for r in inter if r["ended"] and r["transcript"] is not None]
    live_wer = [wer(r["words"], r["transcript"]) for r in turns]
    batch_wer = [wer(r["words"], batch[r["clip"]]) for r in turns if r["clip"] in batch]
    kinds = sorted({r["group"] for r in bc})
    return {
        "interruptions_caught_pct": _pct(sum(r["ended"] for r in inter), len(inter)),
        "heard_stop_ms_p50": _p50(stops),
        "backchannel_cut_pct": _pct(sum(r["ended"] for r in bc), len(bc)),
        "false_cut_resumed_pct": _pct(len(quick), len(paused_bc)),
        "echo_bargeins": sum(1 for r in echo if r["paused"] or r["ended"]),
        "trials": len(judged),
        "void_trials": len(rows) - len(judged),
        "heard_stop_ms_p90": round(statistics.quantiles(stops, n=10)[-1], 1)
        if len(stops) >= 2
        else None,
        "backchannel_paused_pct": _pct(len(paused_bc), len(bc)),
        "resume_after_end_ms_p50": _p50(
            [r["resume_after_end_ms"] for r in paused_bc if r["resume_after_end_ms"] is not None]
        ),
        "backchannel_cut_pct_by_kind": {
            k: _pct(
                sum(r["ended"] for r in bc if r["group"] == k), sum(r["group"] == k for r in bc)
            )
            for k in kinds
        },
        "turn_after_interrupt_wer": round(statistics.mean(live_wer), 3) if live_wer else None,
        "batch_wer_same_clips": round(statistics.mean(batch_wer), 3) if batch_wer else None,
        "cells": {
            c: len([r for r in judged if r["cell"] == c])
            for c in sorted({r["cell"] for r in judged})
        },
    }


async def main_async(args: argparse.Namespace, log: IO[bytes] | None) -> dict[str, Any]:
    transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    load = os.getloadavg()[0]
    probe = probe_ms()
    rows: list[dict[str, Any]] = []
    started = time.time()
    with running_server(args.config, log=log, log_level=args.server_log_level) as (addr, _):
        pool = clips(addr)
        q = question(addr, 8000)
        batch = {c.name: await batch_words(addr, c) for c in pool if c.kind == "interrupt"}
        rng = random.Random(args.seed)
        for transport in transports:
            for cell in cells(transport):
                if args.cells and cell not in args.cells.split(","):
                    continue
                kind = "interrupt" if cell.startswith("interrupt") else "backchannel"
                mine = [] if cell == "echo_only" else [c for c in pool if c.kind == kind]
                rows += await run_cell(addr, transport, cell, mine, args.trials, rng, q, args.trace)
    out: dict[str, Any] = {
        "config": str(args.config),
        "seed": args.seed,
        "loadavg_1m_before": round(load, 2),
        "loadavg_1m_after": round(os.getloadavg()[0], 2),
        "probe_ms": probe,
        "minutes": round((time.time() - started) / 60, 1),
        **summarize(rows, batch),
        "transports": {
            t: summarize([r for r in rows if r["transport"] == t], batch) for t in transports
        },
        "batch_transcripts": batch,
        "rows": rows,
    }
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "cpu.yaml")
    ap.add_argument("--transports", default=",".join(TRANSPORTS))
    ap.add_argument("--trials", type=int, default=20, help="trials per cell")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--trace", action="store_true", help="print each trial's events")
    ap.add_argument("--cells", default="", help="only these cells (comma-separated)")
    ap.add_argument("--server-log", type=Path, help="the server's output goes here")
    ap.add_argument(
        "--server-log-level",
        default="warning",
        help="its level (debug: the words each speech over an answer was heard as, and "
        "what they did)",
    )
    args = ap.parse_args()
    with contextlib.ExitStack() as stack:
        log = stack.enter_context(args.server_log.open("wb")) if args.server_log else None
        out = asyncio.run(main_async(args, log))
    keys = (
        "interruptions_caught_pct",
        "heard_stop_ms_p50",
        "backchannel_cut_pct",
        "false_cut_resumed_pct",
        "echo_bargeins",
        "trials",
    )
    print(f"\n{'':10}" + "".join(f"{k:>26}" for k in keys))
    for name, fig in [("overall", out), *out["transports"].items()]:
        print(f"{name:10}" + "".join(f"{fig[k]!s:>26}" for k in keys))
    for name, fig in out["transports"].items():
        print(
            f"{name}: cut by kind {fig['backchannel_cut_pct_by_kind']}, resume after the sound "
            f"p50 {fig['resume_after_end_ms_p50']} ms, turn WER {fig['turn_after_interrupt_wer']} "
            f"(batch {fig['batch_wer_same_clips']}), void {fig['void_trials']}"
        )
    print(
        f"load {out['loadavg_1m_before']} -> {out['loadavg_1m_after']}, probe {out['probe_ms']} ms"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        import json

        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
