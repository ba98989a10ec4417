"""Live turn latency as a user hears it: end of speech -> first audio of the answer.

Starts the real server (default configs/cpu.yaml) and streams human recordings from
tests/data as a live microphone over ``/v1/realtime``: 20 ms binary PCM16 frames in real
time (``--input-rate``: 24 kHz, the session's default input rate, or 16 kHz), silence
between utterances, utterances with and without mid-sentence pauses (the natural 0.5-0.6 s
pauses at the commas of two_cities.wav, and a 0.8 s pause inserted before a sentence's last
word). ``--voices espeak`` streams short questions rendered by the project's eSpeak NG stage
(engine/stages/tts_espeak.py, 22.05 kHz, resampled to the input rate) instead: synthetic
voices, digital silence between words, no pause inside a sentence. Measured at the client:

* ``live_ttfa_ms``: the last voiced frame sent -> the first ``response.output_audio.delta``
  of a response created after it (p50, p90 over the turns), the first byte;
* ``live_audible_ms``: the last voiced frame sent -> the first *audible* sample of that
  answer (a 5 ms window at -40 dBFS, ``duplex_contract.audible.AudibleStart``: a player that starts
  at the first byte plays it that much later, or when its delta arrives if later): what a
  listener hears, whatever silence a voice opens with;
* ``false_turn_ends``: turns ended (``speech_stopped``) before the utterance's last voiced
  frame was sent (a pause inside a sentence ended the turn);
* ``bargein_flush_ms``: speech onset (first voiced frame sent) ->
  ``input_audio_buffer.speech_started`` (a client flushes its player here);
* ``stream_vs_batch_wer``: WER of the live transcripts minus WER of
  ``POST /v1/audio/transcriptions`` on the same audio (both against the reference text);
* ``breakdown_ms_p50``: where the time goes, per segment, from the server's timeline on
  ``response.done`` (``response.timing``, docs/protocol.md), plus ``network``: the client's
  TTFA minus the server's own (last voice -> first delta written).

    python bench/live_latency.py [--json PATH] [--turns N] [--runs 3] [--config PATH]
        [--input-rate 24000|16000] [--voices human|espeak]
        [--turn-detection server_vad|semantic_vad] [--eagerness auto] [--end-of-turn audio|words]

Runs ``--runs`` consecutive times (a fresh server each), prints each run's p50/p90 with the
load average before it and a machine probe (a fixed pure-Python workload, ms), and reports
the median of the runs.

Prints a per-turn table; with ``--json`` also writes a PNG of the TTFA distribution next to
the JSON (same name, ``.png``). The machine's load average is recorded (other processes on a
shared machine make the figures noisy).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import jiwer
import numpy as np
import soundfile as sf
import soxr
import websockets
from serverproc import ROOT, running_server

sys.path.insert(0, str(ROOT))
from duplex_contract.audible import AudibleStart

RATES = (24000, 16000)  # the client's microphone rate (the session input format)
OUTPUT_RATE = 24000  # the session's output audio (PCM16, the default rate)
DATA = ROOT / "tests" / "data"


@dataclass(frozen=True)
class Utterance:
    name: str
    file: str  # a recording in tests/data, or "espeak": ``text`` rendered by eSpeak NG
    start_s: float
    end_s: float
    text: str  # reference transcript
    paused: bool  # has a pause inside the sentence (must not end the turn)
    gap: tuple[float, float] | None = None  # (at s into the clip, s of silence inserted)


UTTERANCES = [
    Utterance("foolishness", "two_cities.wav", 5.70, 7.40, "it was the age of foolishness", False),
    Utterance("no-matter", "beckett.wav", 3.30, 4.40, "no matter", False),
    Utterance(
        "worst-of_times",  # a 0.8 s pause before the sentence's last word
        "two_cities.wav",
        0.00,
        4.10,
        "it was the best of times it was the worst of times",
        True,
        (3.44, 0.8),
    ),
    Utterance("wisdom", "two_cities.wav", 3.90, 5.50, "it was the age of wisdom", False),
    Utterance("ever-tried", "beckett.wav", 0.10, 1.45, "ever tried", False),
    Utterance(
        "two-cities",
        "two_cities.wav",
        0.00,
        7.95,
        "it was the best of times it was the worst of times it was the age of wisdom "
        "it was the age of foolishness",
        True,
    ),
]


#: short questions, spoken by eSpeak NG (``--voices espeak``); the issue's own among them
QUESTIONS = [
    "What is the capital of France?",
    "How many legs does a spider have?",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water?",
    "Can you recommend a good book?",
    "How far away is the moon?",
]
ESPEAK = [Utterance(f"q{i + 1}", "espeak", 0.0, 0.0, q, False) for i, q in enumerate(QUESTIONS)]


_RENDERED: dict[str, tuple[np.ndarray, int]] = {}


def espeak_render(texts: list[str]) -> dict[str, tuple[np.ndarray, int]]:
    """Each text in eSpeak NG's default voice, through the project's TTS stage: (float32
    samples, their rate). Imported here: the human-voice runs need none of the engine.

    Rendered once per process: libespeak-ng carries state from one synthesis to the next,
    so the same text rendered again comes out a few samples different, and each of
    ``--runs`` would hear (and transcribe) slightly different audio."""
    if all(t in _RENDERED for t in texts):
        return {t: _RENDERED[t] for t in texts}
    import sys

    sys.path.insert(0, str(ROOT))
    from engine.stages.tts_espeak import EspeakOptions, EspeakTts

    tts = EspeakTts(EspeakOptions(), "bench-espeak")
    tts.load()
    out = {}
    for text in texts:
        pcm = tts.synthesize(text, speed=1.0, keep_going=lambda: True)
        out[text] = (np.frombuffer(pcm, "<i2").astype(np.float32) / 32768.0, tts.native_rate)
    _RENDERED.update(out)
    return out


def load(
    u: Utterance, mic_rate: int, rendered: dict[str, tuple[np.ndarray, int]] | None = None
) -> tuple[np.ndarray, bytes, int, int]:
    """(16 kHz float clip, PCM16 clip at ``mic_rate``, first and last voiced mic sample)."""
    if u.file == "espeak":
        assert rendered is not None
        clip, rate = rendered[u.text]
    else:
        data, rate = sf.read(DATA / u.file, dtype="float32")
        if data.ndim > 1:
            data = data.mean(axis=1)
        clip = data[int(u.start_s * rate) : int(u.end_s * rate)]
    if u.gap is not None:
        cut = int(u.gap[0] * rate)
        silence = np.zeros(int(u.gap[1] * rate), dtype=clip.dtype)
        clip = np.concatenate([clip[:cut], silence, clip[cut:]])
    clip16 = soxr.resample(clip, rate, 16000) if rate != 16000 else clip
    mic = soxr.resample(clip, rate, mic_rate) if rate != mic_rate else clip
    win = mic_rate // 100
    rms = np.sqrt(np.convolve(mic**2, np.ones(win) / win, mode="same"))
    voiced = np.nonzero(rms > 0.05 * rms.max())[0]
    pcm = (np.clip(mic, -1, 1) * 32767).astype("<i2").tobytes()
    return clip16, pcm, int(voiced[0]), int(voiced[-1])


def norm(text: str) -> str:
    keep = "".join(c.lower() if c.isalnum() or c == "'" else " " for c in text)
    return " ".join(keep.split())


def wer(ref: str, hyp: str) -> float:
    return float(jiwer.wer(norm(ref), norm(hyp) or "<empty>"))


@dataclass
class Turn:
    utt: Utterance
    onset: float = 0.0
    last_voice: float = 0.0
    events: list[tuple[float, dict[str, Any]]] = field(default_factory=list)

    def row(self, batch_text: str, transcripts_by_item: dict[str, str]) -> dict[str, Any]:
        ttfa = None
        audible = AudibleStart()
        started = None
        stopped_early = 0
        transcripts: list[str] = []
        new_responses: set[str] = set()
        timing: dict[str, float] = {}
        moments: dict[str, float] = {}
        for t, ev in self.events:
            kind = ev["type"]
            if kind == "input_audio_buffer.speech_started" and started is None:
                started = t
            elif kind == "input_audio_buffer.speech_stopped" and t < self.last_voice:
                stopped_early += 1
            if kind == "input_audio_buffer.speech_started":  # this utterance's items
                transcripts.append(transcripts_by_item.get(ev["item_id"], ""))
            elif kind == "response.created" and t >= self.last_voice:
                new_responses.add(ev["response"]["id"])
            elif kind == "response.output_audio.delta" and ev.get("response_id") in new_responses:
                if ttfa is None:
                    ttfa = (t - self.last_voice) * 1000
                audible.feed(t, ev["pcm"], OUTPUT_RATE)
            elif kind == "response.done" and ev["response"]["id"] in new_responses:
                t_info = ev["response"].get("timing") or {}
                if not timing and t_info:
                    timing = dict(t_info.get("segments_ms", {}))
                    moments = dict(t_info.get("moments_ms", {}))
                    if ttfa is not None and "server_total" in timing:
                        # client TTFA minus the server's own (last voice -> written): the
                        # network, the client's event loop and the VAD's estimate error
                        timing["network"] = round(ttfa - timing["server_total"], 1)
        live = " ".join(transcripts)
        marks = (
            "input_audio_buffer.speech_stopped",
            "input_audio_buffer.committed",
            "conversation.item.input_audio_transcription.completed",
            "response.created",
            "response.output_audio.delta",
            "response.done",
        )
        trace: list[str] = []
        for t, ev in self.events:
            if ev["type"] in marks and (not trace or ev["type"] != trace[-1].split("@")[0]):
                trace.append(f"{ev['type']}@{(t - self.last_voice) * 1000:.0f}")
        return {
            "trace": trace,
            "utterance": self.utt.name,
            "paused": self.utt.paused,
            "ttfa_ms": None if ttfa is None else round(ttfa, 1),
            "audible_ms": None
            if audible.at is None
            else round((audible.at - self.last_voice) * 1000, 1),
            "false_turn_ends": stopped_early,
            "flush_ms": None if started is None else round((started - self.onset) * 1000, 1),
            "live_transcript": live,
            "batch_transcript": batch_text,
            "live_wer": round(wer(self.utt.text, live), 3),
            "batch_wer": round(wer(self.utt.text, batch_text), 3),
            "segments_ms": timing,
            "moments_ms": moments,  # the server's, relative to its own last-voice estimate
        }


async def batch_transcript(addr: str, clip16: np.ndarray) -> str:
    buf = io.BytesIO()
    sf.write(buf, clip16, 16000, format="WAV", subtype="PCM_16")
    async with httpx.AsyncClient(timeout=60) as http:
        r = await http.post(
            f"http://{addr}/v1/audio/transcriptions",
            files={"file": ("clip.wav", buf.getvalue(), "audio/wav")},
            data={"model": "whisper"},
        )
        r.raise_for_status()
        return str(r.json()["text"])


def utterances(voices: str) -> list[Utterance]:
    return ESPEAK if voices == "espeak" else UTTERANCES


async def session(addr: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    rate = args.input_rate
    frame = rate // 50  # 20 ms
    utts = utterances(args.voices)
    rendered = espeak_render([u.text for u in utts]) if args.voices == "espeak" else None
    clips = {u.name: load(u, rate, rendered) for u in utts}
    batch = {u.name: await batch_transcript(addr, clips[u.name][0]) for u in utts}
    td: dict[str, Any] = {"type": args.turn_detection}
    if args.turn_detection == "semantic_vad":
        td["eagerness"] = args.eagerness
        td["end_of_turn"] = args.end_of_turn
    silence = b"\0\0" * frame
    async with websockets.connect(f"ws://{addr}/v1/realtime", max_size=None) as ws:
        await ws.send(
            json.dumps(
                {
                    "type": "session.update",
                    "session": {
                        "output_modalities": ["audio"],
                        "max_output_tokens": args.max_tokens,
                        "audio": {
                            "input": {
                                "format": {"type": "audio/pcm", "rate": rate},
                                "turn_detection": td,
                            }
                        },
                    },
                }
            )
        )
        current: list[Turn] = []
        done = asyncio.Event()

        async def reader() -> None:
            async for raw in ws:
                if isinstance(raw, bytes):
                    continue
                now = time.perf_counter()
                ev = json.loads(raw)
                if ev["type"] == "error":
                    print("server error:", ev.get("error"))
                if ev["type"] == "response.output_audio.delta":
                    ev["pcm"] = base64.b64decode(ev["delta"])
                    ev["delta"] = len(ev["pcm"])
                if current:
                    current[-1].events.append((now, ev))
                if ev["type"] == "response.done" and current:
                    if any(
                        e["type"] == "response.created" and t >= current[-1].last_voice > 0
                        for t, e in current[-1].events
                    ):
                        done.set()  # the answer to the latest utterance is complete

        task = asyncio.create_task(reader())
        t = time.perf_counter()

        async def send(frame: bytes) -> float:
            nonlocal t
            await ws.send(frame)
            sent = time.perf_counter()
            t += 0.02
            await asyncio.sleep(max(0.0, t - time.perf_counter()))
            return sent

        for _ in range(50):  # 1 s of silence first
            await send(silence)
        for i in range(args.turns):
            u = utts[i % len(utts)]
            _clip16, pcm, first, last = clips[u.name]
            turn = Turn(u)
            current.append(turn)
            done.clear()
            step = frame * 2
            for off in range(0, len(pcm), step):
                sent = await send(pcm[off : off + step])
                if off // 2 <= first < off // 2 + frame:
                    turn.onset = sent
                if off // 2 <= last < off // 2 + frame:
                    turn.last_voice = sent
            deadline = time.perf_counter() + 30
            while not done.is_set() and time.perf_counter() < deadline:
                await send(silence)
            for _ in range(40):  # 0.8 s of room before the next utterance
                await send(silence)
        deadline = time.perf_counter() + 30  # transcripts still in flight
        while time.perf_counter() < deadline and not all_transcribed(current):
            await send(silence)
        task.cancel()
    by_item = {
        ev["item_id"]: ev.get("transcript", "")
        for turn in current
        for _, ev in turn.events
        if ev["type"] == "conversation.item.input_audio_transcription.completed"
    }
    return [turn.row(batch[turn.utt.name], by_item) for turn in current]


def all_transcribed(turns: list[Turn]) -> bool:
    started = {e["item_id"] for t in turns for _, e in t.events if e["type"].endswith("started")}
    done = {
        e["item_id"]
        for t in turns
        for _, e in t.events
        if e["type"] == "conversation.item.input_audio_transcription.completed"
    }
    return started <= done


def p(vals: list[float], q: float) -> float | None:
    if not vals:
        return None
    return round(float(np.percentile(vals, q)), 1)


def summarize(rows: list[dict[str, Any]], args: argparse.Namespace, load: str) -> dict[str, Any]:
    ttfa = [r["ttfa_ms"] for r in rows if r["ttfa_ms"] is not None]
    audible = [r["audible_ms"] for r in rows if r["audible_ms"] is not None]
    flush = [r["flush_ms"] for r in rows if r["flush_ms"] is not None]
    segs: dict[str, list[float]] = {}
    for r in rows:
        for k, v in r["segments_ms"].items():
            segs.setdefault(k, []).append(v)
    live_wer = statistics.mean(r["live_wer"] for r in rows)
    batch_wer = statistics.mean(r["batch_wer"] for r in rows)
    return {
        "config": str(args.config),
        "turn_detection": args.turn_detection,
        "eagerness": args.eagerness if args.turn_detection == "semantic_vad" else None,
        "end_of_turn": args.end_of_turn if args.turn_detection == "semantic_vad" else None,
        "input_rate": args.input_rate,
        "voices": args.voices,
        "turns": len(rows),
        "load_average": load,
        "live_ttfa_ms_p50": p(ttfa, 50),
        "live_ttfa_ms_p90": p(ttfa, 90),
        "live_audible_ms_p50": p(audible, 50),
        "live_audible_ms_p90": p(audible, 90),
        "false_turn_ends": sum(r["false_turn_ends"] for r in rows),
        "bargein_flush_ms_p50": p(flush, 50),
        "stream_vs_batch_wer": round(live_wer - batch_wer, 3),
        "live_wer": round(live_wer, 3),
        "batch_wer": round(batch_wer, 3),
        "breakdown_ms_p50": {k: p(v, 50) for k, v in segs.items()},
        "missing_audio": sum(1 for r in rows if r["ttfa_ms"] is None),
        "rows": rows,
    }


def plot(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ttfa = sorted(r["ttfa_ms"] for r in out["rows"] if r["ttfa_ms"] is not None)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.hist(ttfa, bins=max(5, len(ttfa) // 2), color="#4a7")
    a.axvline(850, color="r", ls="--", label="goal p50 850 ms")
    a.set_xlabel("last voiced frame -> first audio delta (ms)")
    a.set_ylabel("turns")
    a.legend()
    a.set_title(f"live TTFA, p50 {out['live_ttfa_ms_p50']} ms, p90 {out['live_ttfa_ms_p90']} ms")
    parts = ("silence_wait", "asr", "llm", "tts", "send", "network")
    bd = {k: out["breakdown_ms_p50"][k] for k in parts if out["breakdown_ms_p50"].get(k)}
    left = 0.0
    for k, v in bd.items():
        b.barh([0], [v], left=left, label=f"{k} {v:.0f}")
        left += v
    b.set_yticks([])
    b.set_xlabel("ms (p50 per segment)")
    b.legend(fontsize=8, loc="upper right")
    b.set_title("where the time goes (server timeline)")
    fig.suptitle(
        f"{out['turn_detection']}, {out['voices']} voices at {out['input_rate']} Hz"
        f" - load {out['load_average']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def speculation_counts(addr: str) -> dict[str, dict[str, int]]:
    """The server's speculation counters after the run (pause guesses and drafts by outcome),
    from /metrics: how often the work done during a pause was used."""
    text = httpx.get(f"http://{addr}/metrics", timeout=10).text
    out: dict[str, dict[str, int]] = {}
    for family, key in (
        ("duplex_speculative_transcripts_total", "transcripts"),
        ("duplex_speculative_responses_total", "responses"),
    ):
        for m in re.finditer(rf'^{family}\{{outcome="(\w+)"\}} (\S+)$', text, re.M):
            out.setdefault(key, {})[m.group(1)] = int(float(m.group(2)))
    return out


def probe_ms() -> float:
    """A fixed pure-Python workload (ms): how fast this machine's cores are right now
    (machines of one kind differ up to 2x)."""
    t = time.perf_counter()
    acc = 0.0
    for i in range(1_000_000):
        acc += i**0.5
    return round((time.perf_counter() - t) * 1000, 1)


def one_run(args: argparse.Namespace) -> dict[str, Any]:
    with running_server(args.config) as (addr, _):
        load_before = os.getloadavg()
        probe = probe_ms()
        rows = asyncio.run(session(addr, args))
        load_after = os.getloadavg()
        speculation = speculation_counts(addr)
    load = f"{load_before[0]:.2f} before, {load_after[0]:.2f} after (1-min avg, 2 cores)"
    out = summarize(rows, args, load)
    out["loadavg_1m_before"] = round(load_before[0], 2)
    out["probe_ms"] = probe
    out["speculation"] = speculation
    print(
        f"{'turn':<12} {'ttfa ms':>8} {'audible':>8} {'false':>5} {'flush':>6}"
        "  live | batch transcript"
    )
    for r in rows:
        print(
            f"{r['utterance']:<12} {r['ttfa_ms'] or float('nan'):>8.1f} "
            f"{r['audible_ms'] or float('nan'):>8.1f} "
            f"{r['false_turn_ends']:>5} {r['flush_ms'] or float('nan'):>6.1f}  "
            f"{r['live_transcript']!r} | {r['batch_transcript']!r}"
        )
    keys = ["live_ttfa_ms_p50", "live_ttfa_ms_p90", "live_audible_ms_p50", "live_audible_ms_p90"]
    keys += ["false_turn_ends", "bargein_flush_ms_p50"]
    keys += ["stream_vs_batch_wer", "live_wer", "batch_wer", "breakdown_ms_p50", "load_average"]
    keys += ["probe_ms", "speculation"]
    for k in keys:
        print(f"{k}: {out[k]}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "cpu.yaml")
    ap.add_argument("--turns", type=int, default=12)
    ap.add_argument("--runs", type=int, default=3, help="consecutive runs (median reported)")
    ap.add_argument(
        "--input-rate",
        type=int,
        choices=RATES,
        default=24000,
        help="the microphone's PCM16 rate, the session's input format (Hz)",
    )
    ap.add_argument(
        "--voices",
        choices=("human", "espeak"),
        default="human",
        help="human recordings (tests/data) or short questions spoken by eSpeak NG",
    )
    ap.add_argument("--turn-detection", default="server_vad")
    ap.add_argument("--eagerness", default="auto")
    ap.add_argument(
        "--end-of-turn",
        choices=("audio", "words"),
        default="audio",
        help="semantic_vad: what judges a pause (Smart Turn on the audio, or the words)",
    )
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    runs = []
    for i in range(args.runs):
        print(
            f"--- run {i + 1} of {args.runs} ({args.voices} voices, {args.input_rate} Hz), "
            f"load average {os.getloadavg()[0]:.2f}"
        )
        runs.append(one_run(args))
    out: dict[str, Any] = {"input_rate": args.input_rate, "voices": args.voices}
    medians = ("live_ttfa_ms_p50", "live_ttfa_ms_p90", "live_audible_ms_p50", "live_audible_ms_p90")
    for key in (*medians, "false_turn_ends"):
        vals = [r[key] for r in runs if r[key] is not None]
        out[key] = statistics.median(vals) if vals else None
    out["runs"] = runs
    print(
        f"{'run':<4} {'p50 ms':>8} {'p90 ms':>8} {'aud p50':>8} {'aud p90':>8} {'false':>5}"
        f" {'load':>5} {'probe ms':>8}"
    )
    nan = float("nan")
    for i, r in enumerate(runs, 1):
        print(
            f"{i:<4} {r['live_ttfa_ms_p50'] or nan:>8.1f} "
            f"{r['live_ttfa_ms_p90'] or nan:>8.1f} {r['live_audible_ms_p50'] or nan:>8.1f} "
            f"{r['live_audible_ms_p90'] or nan:>8.1f} {r['false_turn_ends']:>5} "
            f"{r['loadavg_1m_before']:>5.2f} {r['probe_ms']:>8.1f}"
        )
    print(
        f"median of {len(runs)}: first byte p50 {out['live_ttfa_ms_p50']} ms, "
        f"p90 {out['live_ttfa_ms_p90']} ms; first audible p50 {out['live_audible_ms_p50']} ms,"
        f" p90 {out['live_audible_ms_p90']} ms; false turn ends {out['false_turn_ends']}"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2))
        plot(runs[-1], args.json.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
