"""End of turn, offline: how much dead air each turn detector leaves after a finished turn,
and how often it cuts a speaker off, on a labelled turn set of real speech.

No server: the session's own input code (duplex_server/session/input_processor.py's
``InputProcessor``, as the server builds it for a session's ``turn_detection``: Silero VAD,
``VadSegmenter``, and Smart Turn for ``semantic_vad``) is fed each turn as a client sends it,
PCM16 16 kHz in 20 ms pieces, and the piece after which it emits ``speech_stopped`` is the
turn's end. Time is the audio's (simulated): the figures do not depend on this machine's
speed, except that Smart Turn's and the VAD's compute time, which a live server adds, is not
counted. The load and ``probe_ms`` are printed beside them as in the other benches.

The set (bench/turn_end_set.py, cached under .cache/turn_end/): the shipped human recordings
and the project's two TTS voices (Piper, eSpeak NG), each utterance as three turns labelled
by construction: ``complete`` (then 4 s of quiet), ``cut`` (stopped at a word boundary
mid-sentence) and ``paused`` (0.4-1.2 s of silence inserted at a word boundary, then the
rest). Detectors: ``server_vad`` at several silence windows, ``semantic_vad`` at each
eagerness (``auto`` is ``medium``: the same threshold and wait), and ``semantic_vad`` with
``end_of_turn: words`` at each eagerness (family ``words``): at each pause the engine's
Whisper stage transcribes the input so far, as the engine's pause guess does, and the front
end's verdict (duplex_server/session/turn_words.py) scores the words. Both are computed here,
and their measured compute time is counted: the verdict reaches the input processor
(``end_turn``) with the first 20 ms piece after it. These figures alone depend on this
machine's speed (~0.25 s a verdict on two cores); ``--no-words`` leaves them out. Figures
per setting:

* ``false_cutoff_pct``: paused turns ended before their speech was over (in the pause,
  or at a pause of the speech itself);
* ``complete_cutoff_pct``: complete turns ended before their last voiced sample (e.g.
  two_cities.wav's 0.5-0.6 s comma pauses);
* ``dead_air_ms_p50`` / ``p90``: complete turns, last voiced sample -> the turn's end;
* ``cut_wait_ms_p50``: cut turns, last voiced sample -> the turn's end (a speaker who
  stopped mid-sentence and goes on within this much keeps the turn), and
  ``cut_ended_2s_pct``: cut turns ended within 2 s of the stop;
* ``missed``: turns never ended (the VAD heard no speech, or nothing ended it in 4 s).

Per family, ``dead_air_ms_at_5pct`` (``_10pct``): the lowest ``dead_air_ms_p50`` among its
settings whose ``false_cutoff_pct`` is at most 5 % (10 %), no interpolation, and which
setting that is (null when none qualifies), and ``false_cutoff_pct`` at the family's
default (server_vad 500 ms, semantic_vad auto). The top-level ``false_cutoff_pct`` and
``dead_air_ms_p50`` are the default detector's (configs/cpu.yaml sets no turn detection, so
a session gets ``TurnDetection()``: server_vad, 500 ms); ``dead_air_ms_at_5pct`` is its
family's.

    python bench/turn_end.py [--seed 1] [--limit N] [--json PATH] [--no-words]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from audio_kit.pcm import edge_trim
from audio_kit.smart_turn import SmartTurn
from audio_kit.vad import SileroVad, VadSegmenter, VadStream
from bench.probe import probe_ms
from bench.turn_end_set import RATE, Turn, build, utterances
from duplex_server.protocol.codec import AudioFormat
from duplex_server.protocol.events import TurnDetection
from duplex_server.protocol.session_config import SEMANTIC_MAX_WAIT_MS
from duplex_server.protocol.vad_events import VadPause, VadResume, VadStart, VadStop
from duplex_server.session.input_processor import InputProcessor
from duplex_server.session.turn_words import WORDS_THRESHOLD, SentenceEnd

PIECE_MS = 20
PIECE_BYTES = RATE * PIECE_MS // 1000 * 2
SERVER_WINDOWS_MS = (200, 300, 400, 500, 700, 1000, 1200, 1500)
EAGERNESS = ("low", "medium", "high")
CUT_HOLD_S = 2.0
#: the engine's ASR trims a guess's quiet edges to this (configs/cpu.yaml edge_margin_ms)
EDGE_MARGIN_MS = 150
#: what a session gets with configs/cpu.yaml (no turn_detection there: the protocol default)
DEFAULT_TD = TurnDetection()
FORMAT = AudioFormat("pcm16", RATE)
#: each family's setting a session gets without one (semantic_vad: auto, the same as medium)
FAMILY_DEFAULT = {
    "server_vad": f"server_vad_{DEFAULT_TD.silence_duration_ms}",
    "semantic_vad": "semantic_vad_medium",
    "words": "words_medium",
}


@dataclass(frozen=True)
class Detector:
    name: str
    family: str
    setting: str
    td: TurnDetection


def detectors(words: bool = False) -> list[Detector]:
    out = [
        Detector(f"server_vad_{w}", "server_vad", f"{w} ms", TurnDetection(silence_duration_ms=w))
        for w in SERVER_WINDOWS_MS
    ]
    for e in EAGERNESS:
        # as session.update sets it (protocol/session_config.py): the eagerness's longest wait
        td = TurnDetection(
            type="semantic_vad", eagerness=e, silence_duration_ms=SEMANTIC_MAX_WAIT_MS[e]
        )
        out.append(Detector(f"semantic_vad_{e}", "semantic_vad", e, td))
    if words:
        for e in EAGERNESS:
            td = TurnDetection(
                type="semantic_vad",
                eagerness=e,
                end_of_turn="words",
                silence_duration_ms=SEMANTIC_MAX_WAIT_MS[e],
            )
            out.append(Detector(f"words_{e}", "words", e, td))
    return out


class WordsJudge:
    """What ``end_of_turn: words`` learns at a pause, as a live session learns it: the
    engine's pause guess (its Whisper stage, engine/stages/asr_whisper.py, with the
    configs/cpu.yaml options, on the input from speech_started's audio_start_ms to the
    pause) and the front end's verdict on those words (duplex_server/session/turn_words.py).
    Each pause is transcribed and scored once per run (the eagerness levels share them);
    the compute time of both is measured here and counted: the verdict is usable only that
    long after the pause."""

    def __init__(self) -> None:
        from engine.stages.asr_whisper import WhisperAsr, WhisperOptions

        self.asr = WhisperAsr(WhisperOptions(cpu_threads=1, max_batch=1), "turn-end-asr")
        self.asr.load()
        self.model = SentenceEnd.shared()
        self._seen: dict[tuple[str, float], tuple[str, float, float]] = {}

    def verdict_ms_p50(self) -> float | None:
        ms = [v[2] for v in self._seen.values()]
        return round(statistics.median(ms), 1) if ms else None

    def at_pause(
        self, key: str, audio: npt.NDArray[np.float32], at_ms: float
    ) -> tuple[str, float, float]:
        """The words of ``audio`` (the input up to a pause), P(they end a sentence), and
        the ms both took."""
        seen = self._seen.get((key, at_ms))
        if seen is None:
            t0 = time.perf_counter()
            text = self.asr.transcribe(edge_trim(audio, RATE, EDGE_MARGIN_MS), "en")
            p = self.model.probability(text)
            seen = (text, p, (time.perf_counter() - t0) * 1000)
            self._seen[(key, at_ms)] = seen
        return seen


def default_name() -> str:
    d = DEFAULT_TD
    assert d.type == "server_vad"
    return f"server_vad_{d.silence_duration_ms}"


def pcm16(audio: npt.NDArray[np.float32]) -> bytes:
    return bytes((np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes())


def vad_probabilities(pcm: bytes) -> list[float]:
    """Silero's probability of each 32 ms chunk of ``pcm``, as a session's lane scores them
    (the chunks do not depend on the turn detection, so every detector reuses them)."""
    stream = VadStream(SileroVad(), VadSegmenter())
    return [stream.detector.probability(c) for c in stream.split(pcm)]


def turn_end(
    td: TurnDetection,
    pcm: bytes,
    probs: list[float],
    judge: WordsJudge | None = None,
    turn: Turn | None = None,
) -> float | None:
    """Feed ``pcm`` in 20 ms pieces to a session's input processor for ``td``: the time (s)
    at the end of the piece after which it emitted the first ``speech_stopped``, or None.
    ``end_of_turn: words`` (``judge`` and ``turn`` given): each pause's words are judged
    and a finished verdict is handed to the processor (``end_turn``, as the session's
    ``EndTurn`` does) with the first piece after the verdict's compute time."""
    proc = InputProcessor(FORMAT, td, "silero")
    scores = iter(probs)
    words = td.end_of_turn == "words" and judge is not None and turn is not None
    threshold = WORDS_THRESHOLD[td.eagerness or "auto"]
    start_ms = 0.0
    verdict: tuple[float, float] | None = None  # (usable from ms, the pause's at_ms)
    for off in range(0, len(pcm), PIECE_BYTES):
        if verdict is not None and off / 2 / RATE * 1000 >= verdict[0]:
            proc.end_turn(verdict[1])
            verdict = None
        _, chunks = proc.prepare(pcm[off : off + PIECE_BYTES])
        events = proc.events([next(scores) for _ in chunks], chunks, 0.0)
        if any(isinstance(e, VadStop) for e in events):
            return min(off + PIECE_BYTES, len(pcm)) / 2 / RATE
        if not words:
            continue
        assert judge is not None and turn is not None
        for e in events:
            if isinstance(e, VadStart):
                start_ms = e.audio_start_ms
            elif isinstance(e, VadResume):
                verdict = None
            elif isinstance(e, VadPause):
                audio = turn.audio[int(start_ms * RATE / 1000) : int(e.at_ms * RATE / 1000)]
                _, p, ms = judge.at_pause(turn.name, audio, e.at_ms)
                verdict = (e.at_ms + ms, e.at_ms) if p >= threshold else None
    return None


@contextlib.contextmanager
def memoized_smart_turn() -> Iterator[None]:
    """Smart Turn's verdict is a pure function of the audio it hears: the eagerness levels
    ask it about the same pauses, so each distinct audio is scored once (while this lasts)."""
    model = SmartTurn.shared()
    score = model.probability
    cache: dict[bytes, float] = {}

    def probability(audio: npt.NDArray[np.float32]) -> float:
        key = np.asarray(audio, dtype=np.float32).tobytes()
        if key not in cache:
            cache[key] = score(audio)
        return cache[key]

    model.probability = probability  # type: ignore[method-assign]
    try:
        yield
    finally:
        del model.probability  # the class's method again


def measure(turn: Turn, end: float | None) -> dict[str, Any]:
    """One turn's outcome under one detector."""
    row: dict[str, Any] = {
        "turn": turn.name,
        "kind": turn.kind,
        "source": turn.source,
        "end_s": None if end is None else round(end, 3),
        "speech_end_s": round(turn.speech_end_s, 3),
    }
    if end is None:
        row["missed"] = True
        return row
    after_ms = (end - turn.speech_end_s) * 1000
    row["cutoff"] = after_ms < 0
    if turn.kind == "complete" and after_ms >= 0:
        row["dead_air_ms"] = round(after_ms, 1)
    if turn.kind == "cut":
        row["wait_ms"] = round(after_ms, 1)
    return row


def _pct(part: int, whole: int) -> float | None:
    return round(100.0 * part / whole, 1) if whole else None


def _q(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return round(values[0], 1)
    return round(statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1], 1)


def summarize(rows: list[dict[str, Any]], by_source: bool = True) -> dict[str, Any]:
    def of(kind: str) -> list[dict[str, Any]]:
        return [r for r in rows if r["kind"] == kind]

    paused, complete, cut = of("paused"), of("complete"), of("cut")
    dead = [r["dead_air_ms"] for r in complete if "dead_air_ms" in r]
    waits = [r["wait_ms"] for r in cut if "wait_ms" in r]
    return {
        "false_cutoff_pct": _pct(sum(bool(r.get("cutoff")) for r in paused), len(paused)),
        "complete_cutoff_pct": _pct(sum(bool(r.get("cutoff")) for r in complete), len(complete)),
        "dead_air_ms_p50": _q(dead, 50),
        "dead_air_ms_p90": _q(dead, 90),
        "cut_wait_ms_p50": _q(waits, 50),
        "cut_ended_2s_pct": _pct(sum(w < CUT_HOLD_S * 1000 for w in waits), len(cut)),
        "missed": sum(bool(r.get("missed")) for r in rows),
        "turns": {"complete": len(complete), "cut": len(cut), "paused": len(paused)},
        **({"by_source": _by_source(rows)} if by_source else {}),
    }


def _by_source(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The main figures per source of the speech (human, piper, espeak)."""
    keys = ("false_cutoff_pct", "complete_cutoff_pct", "dead_air_ms_p50", "cut_wait_ms_p50")
    out = {}
    for source in sorted({r["source"] for r in rows}):
        s = summarize([r for r in rows if r["source"] == source], by_source=False)
        out[source] = {k: s[k] for k in keys}
    return out


def at_rate(settings: dict[str, dict[str, Any]], pct: float) -> tuple[float | None, str | None]:
    """The lowest dead air (p50) among settings whose false cut-off rate is at most ``pct``
    (the best qualifying setting; no interpolation) and that setting."""
    ok = [
        (s["dead_air_ms_p50"], name)
        for name, s in settings.items()
        if s["false_cutoff_pct"] is not None
        and s["false_cutoff_pct"] <= pct
        and s["dead_air_ms_p50"] is not None
    ]
    if not ok:
        return None, None
    return min(ok)


def run(
    turns: list[Turn], dets: list[Detector], trace: bool = False, judge: WordsJudge | None = None
) -> dict[str, Any]:
    """Every detector over every turn: per-detector figures and per-turn rows."""
    rows: dict[str, list[dict[str, Any]]] = {d.name: [] for d in dets}
    with memoized_smart_turn():
        for turn in turns:
            pcm = pcm16(turn.audio)
            probs = vad_probabilities(pcm)
            for d in dets:
                row = measure(turn, turn_end(d.td, pcm, probs, judge, turn))
                rows[d.name].append(row)
                if trace:
                    print(d.name, row)
    families: dict[str, Any] = {}
    for d in dets:
        fam = families.setdefault(d.family, {"settings": {}})
        fam["settings"][d.name] = {"setting": d.setting, **summarize(rows[d.name])}
    for family, fam in families.items():
        for pct in (5, 10):
            ms, name = at_rate(fam["settings"], pct)
            fam[f"dead_air_ms_at_{pct}pct"] = ms
            fam[f"setting_at_{pct}pct"] = name
        # the family's false cut-offs at its default: server_vad's 500 ms, the others' auto
        default = FAMILY_DEFAULT.get(family)
        if default in fam["settings"]:
            fam["default_setting"] = default
            fam["false_cutoff_pct"] = fam["settings"][default]["false_cutoff_pct"]
    return {"detectors": families, "rows": rows}


def table(out: dict[str, Any]) -> str:
    keys = (
        "false_cutoff_pct",
        "complete_cutoff_pct",
        "dead_air_ms_p50",
        "dead_air_ms_p90",
        "cut_wait_ms_p50",
        "cut_ended_2s_pct",
        "missed",
    )
    lines = [f"{'detector':20}" + "".join(f"{k:>21}" for k in keys)]
    for fam in out["detectors"].values():
        for name, s in fam["settings"].items():
            lines.append(f"{name:20}" + "".join(f"{s[k]!s:>21}" for k in keys))
    sources = ("human", "piper", "espeak")
    lines += ["", "false_cutoff_pct by source of the speech:"]
    lines.append(f"{'detector':20}" + "".join(f"{k:>9}" for k in sources))
    for fam in out["detectors"].values():
        for name, s in fam["settings"].items():
            by = s["by_source"]
            cells = "".join(f"{by.get(k, {}).get('false_cutoff_pct')!s:>9}" for k in sources)
            lines.append(f"{name:20}{cells}")
    for family, fam in out["detectors"].items():
        lines.append(
            f"{family}: dead air p50 at <= 5% false cut-offs {fam['dead_air_ms_at_5pct']} ms "
            f"({fam['setting_at_5pct']}), at <= 10% {fam['dead_air_ms_at_10pct']} ms "
            f"({fam['setting_at_10pct']})"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=1, help="the set's boundaries and pauses")
    ap.add_argument("--limit", type=int, default=0, help="only the first N utterances")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--trace", action="store_true", help="print each turn's outcome")
    ap.add_argument(
        "--no-words",
        action="store_true",
        help="leave out end_of_turn: words (it transcribes every pause: ~3 min more)",
    )
    args = ap.parse_args()
    load, probe = os.getloadavg()[0], probe_ms()
    started = time.time()
    utts = utterances()
    turns = build(args.seed, utts[: args.limit] if args.limit else utts)
    judge = None if args.no_words else WordsJudge()
    res = run(turns, detectors(words=judge is not None), args.trace, judge)
    default = res["detectors"]["server_vad"]["settings"][default_name()]
    out: dict[str, Any] = {
        "seed": args.seed,
        "turns": len(turns),
        "default_detector": default_name(),
        "false_cutoff_pct": default["false_cutoff_pct"],
        "dead_air_ms_p50": default["dead_air_ms_p50"],
        "dead_air_ms_at_5pct": res["detectors"]["server_vad"]["dead_air_ms_at_5pct"],
        "dead_air_ms_at_10pct": res["detectors"]["server_vad"]["dead_air_ms_at_10pct"],
        "simulated_time": True,
        # the words family's verdicts: the compute of the guess's ASR and the scoring (ms)
        "words_verdict_ms_p50": None if judge is None else judge.verdict_ms_p50(),
        "loadavg_1m_before": round(load, 2),
        "loadavg_1m_after": round(os.getloadavg()[0], 2),
        "probe_ms": probe,
        "minutes": round((time.time() - started) / 60, 1),
        **res,
    }
    print(f"{len(turns)} turns ({default['turns']}), seed {args.seed}; simulated time")
    print(table(out))
    print(
        f"default {out['default_detector']}: false cut-offs {out['false_cutoff_pct']}%, "
        f"dead air p50 {out['dead_air_ms_p50']} ms"
    )
    if judge is not None:
        ms = out["words_verdict_ms_p50"]
        print(f"words: a verdict (the guess's ASR and the scoring) took {ms} ms (p50)")
    print(
        f"load {out['loadavg_1m_before']} -> {out['loadavg_1m_after']}, probe {out['probe_ms']} ms"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
