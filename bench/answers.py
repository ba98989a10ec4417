"""Spoken answers a listener can use: plain questions asked aloud, answers judged by keywords.

Starts the real server (default configs/cpu.yaml) and asks :data:`QUESTIONS` aloud over
``/v1/realtime``, the way bench/live_latency.py streams a microphone: each question rendered
once by the project's Piper stage (engine/stages/tts_piper.py, its noise set to 0 so every run
hears the same audio; Whisper-base misheard 5 of these 32 this way, eSpeak NG's voices 13-18),
sent as 20 ms binary PCM16 frames in real time, server VAD ending the turn. The listener
is polite: after an answer is complete it waits until the answer's audio has played (its
duration from the first audio delta) and 0.8 s more before asking the next question, so no
answer is cut off. All questions are asked in one session (a conversation: earlier answers
are in the prompt), or each in a fresh session with ``--fresh``.

Each answer (the spoken transcript, ``response.output_audio_transcript.done``) is judged by
:func:`judge`; a turn is *ok* when the answer

* contains an expected keyword (every group of :attr:`Question.keywords` has one match),
* is English (:func:`is_english`),
* has at most :data:`MAX_WORDS` words,
* does not loop: no 3-word phrase occurs three times (:func:`loops`).

Printed and written (``--json``): ``answers_ok_pct`` (the share of ok turns, the median over
``--runs``), ``loops`` (answers that loop), ``mean_words``, ``ttfa_ms_p50``/``p90`` (last voiced
frame sent -> first audio delta of the answer, bench/live_latency.py's measure) and every turn
with what the server heard and answered.

    python bench/answers.py [--runs 3] [--json PATH] [--config PATH] [--fresh]
        [--only N] [--input-rate 16000|24000]

The question set is fixed: it was committed before any prompt or sampling change that it
measures and is never edited (a change to it would make old and new figures incomparable;
add a new set beside it instead).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

MAX_WORDS = 25  # an answer longer than this is not a spoken one-to-two-sentence answer


@dataclass(frozen=True)
class Question:
    text: str
    #: groups of alternatives: every group must have one alternative in the answer
    keywords: tuple[tuple[str, ...], ...]
    kind: str  # fact | smalltalk | instruction


def _q(text: str, kind: str, *groups: tuple[str, ...]) -> Question:
    return Question(text, tuple(groups), kind)


#: The fixed question set (never edited: see the module docstring).
QUESTIONS: tuple[Question, ...] = (
    _q("What is the capital of France?", "fact", ("paris",)),
    _q("How many legs does a spider have?", "fact", ("eight", "8")),
    _q("What color is the sky on a clear day?", "fact", ("blue",)),
    _q("What do bees make?", "fact", ("honey",)),
    _q("What language is spoken in Spain?", "fact", ("spanish", "castilian")),
    _q("What is the largest planet in our solar system?", "fact", ("jupiter",)),
    _q("How many days are in a week?", "fact", ("seven", "7")),
    _q("What do we call frozen water?", "fact", ("ice",)),
    _q("Which farm animal gives us milk?", "fact", ("cow", "cows", "cattle", "goat", "goats")),
    _q("Who wrote Romeo and Juliet?", "fact", ("shakespeare",)),
    _q("What is the opposite of hot?", "fact", ("cold",)),
    _q("How many hours are in a day?", "fact", ("24", "twenty four", "twenty-four")),
    _q("What color is a ripe banana?", "fact", ("yellow",)),
    _q("What is the capital of Japan?", "fact", ("tokyo",)),
    _q("What is two plus two?", "fact", ("four", "4")),
    _q("Which planet do we live on?", "fact", ("earth",)),
    _q("What is the tallest animal in the world?", "fact", ("giraffe", "giraffes")),
    _q("How many months are in a year?", "fact", ("twelve", "12")),
    _q("In which country is the Eiffel Tower?", "fact", ("france", "paris")),
    _q("What do cats like to drink?", "fact", ("milk", "water")),
    _q(
        "Hello, how are you today?",
        "smalltalk",
        ("good", "fine", "well", "great", "thank", "thanks", "help", "doing"),
    ),
    _q("What is your name?", "smalltalk", ("assistant", "name", "i'm", "i am", "call me")),
    _q("Good morning!", "smalltalk", ("morning", "hello", "hi", "good", "help")),
    _q(
        "Thank you for your help.",
        "smalltalk",
        ("welcome", "pleasure", "glad", "happy", "anytime", "no problem"),
    ),
    _q(
        "What can you help me with?",
        "smalltalk",
        ("help", "answer", "questions", "assist", "anything", "information"),
    ),
    _q("Goodbye, see you later!", "smalltalk", ("bye", "goodbye", "see you", "later", "care")),
    _q("Count from one to five.", "instruction", ("three", "3"), ("five", "5")),
    _q(
        "Name a fruit that is red.",
        "instruction",
        (
            "apple",
            "apples",
            "strawberry",
            "strawberries",
            "cherry",
            "cherries",
            "raspberry",
            "raspberries",
            "tomato",
            "watermelon",
            "pomegranate",
            "cranberry",
            "cranberries",
        ),
    ),
    _q("Say something nice about dogs.", "instruction", ("dog", "dogs")),
    _q(
        "Give me a word that rhymes with cat.",
        "instruction",
        ("hat", "bat", "mat", "rat", "sat", "fat", "pat", "chat", "flat", "that", "vat", "brat"),
    ),
    _q("Name the two days of the weekend.", "instruction", ("saturday",), ("sunday",)),
    _q(
        "What should I take with me when it rains?",
        "instruction",
        ("umbrella", "raincoat", "coat", "jacket", "boots"),
    ),
)


# ---------------------------------------------------------------------------- the judge
_EN = frozenset(
    "the a an is are was be it i you we they he she this that of to in on at for with and or "
    "but not my your our what how do does can will have has there here yes no".split()
)
#: frequent function words of the languages a small model drifts into (French, Spanish,
#: Italian, German, Portuguese)
_FOREIGN = (
    frozenset(
        "le la les est et des une du un dans pour qui que sont avec je vous nous il elle "
        "el los las es y una del por con para lo su como pero muy "
        "il lo gli della di che sono non per una "
        "der die das und ist nicht ein eine mit sie ich zu von "
        "os da do em não uma com".split()
    )
    - _EN
)


def words(text: str) -> list[str]:
    """Lower-case words (letters, digits, apostrophes) of ``text``."""
    return re.findall(r"[^\W_]+(?:'[^\W_]+)?", text.lower())


def is_english(text: str) -> bool:
    """English by a plain test: at most 2% of its letters outside ASCII, and no more
    frequent foreign function words than English ones (an answer with neither, "Paris.",
    counts as English)."""
    letters = [c for c in text if c.isalpha()]
    if letters and sum(not c.isascii() for c in letters) > 0.02 * len(letters):
        return False
    ws = words(text)
    en = sum(w in _EN for w in ws)
    foreign = sum(w in _FOREIGN for w in ws)
    return foreign <= en or foreign < 2


def loops(text: str) -> bool:
    """Some 3-word phrase occurs three times or more."""
    ws = words(text)
    counts: dict[tuple[str, ...], int] = {}
    for i in range(len(ws) - 2):
        key = tuple(ws[i : i + 3])
        counts[key] = counts.get(key, 0) + 1
        if counts[key] >= 3:
            return True
    return False


def has_keywords(text: str, groups: tuple[tuple[str, ...], ...]) -> bool:
    """Every group has an alternative in ``text`` as whole words (case and punctuation
    ignored: "c-a-t" matches "c a t", "twenty-four" matches "twenty four")."""
    norm = f" {' '.join(words(text.replace('-', ' ')))} "
    return all(
        any(f" {' '.join(words(alt.replace('-', ' ')))} " in norm for alt in group)
        for group in groups
    )


@dataclass(frozen=True)
class Verdict:
    ok: bool
    keyword: bool
    english: bool
    short: bool
    looped: bool
    n_words: int


def judge(answer: str, question: Question) -> Verdict:
    """The answer's verdict (see the module docstring)."""
    n = len(words(answer))
    keyword = has_keywords(answer, question.keywords)
    english = is_english(answer)
    looped = loops(answer)
    short = 0 < n <= MAX_WORDS
    return Verdict(keyword and english and short and not looped, keyword, english, short, looped, n)


# ---------------------------------------------------------------------------- the voice
def render(texts: list[str], rate: int) -> dict[str, tuple[bytes, int]]:
    """Each text spoken by the project's Piper stage (noise 0: the same samples every time),
    as PCM16 at ``rate`` and the index of its last voiced sample (a 10 ms window above 5%
    of the loudest, bench/live_latency.py's rule)."""
    import numpy as np
    import soxr

    sys.path.insert(0, str(ROOT))
    from engine.stages.tts_piper import PiperOptions, PiperTts

    tts = PiperTts(PiperOptions(threads=1, noise_scale=0.0, noise_w_scale=0.0), "bench-piper")
    tts.load()
    out = {}
    for text in texts:
        clip = np.concatenate(list(tts.synthesize(text, speed=1.0)))
        mic = soxr.resample(clip, tts.native_rate, rate)
        win = rate // 100
        rms = np.sqrt(np.convolve(mic**2, np.ones(win) / win, mode="same"))
        last = int(np.nonzero(rms > 0.05 * rms.max())[0][-1])
        out[text] = ((np.clip(mic, -1, 1) * 32767).astype("<i2").tobytes(), last)
    tts.unload()
    return out


# ---------------------------------------------------------------------------- the session
@dataclass
class Turn:
    question: Question
    last_voice: float = 0.0
    heard: str = ""  # the user transcript
    answer: str = ""
    ttfa_ms: float | None = None
    audio_ms: float = 0.0
    first_audio: float | None = None
    responses: set[str] = field(default_factory=set)
    segments_ms: dict[str, float] = field(default_factory=dict)  # the server's timeline
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def row(self) -> dict[str, Any]:
        v = judge(self.answer, self.question)
        return {
            "question": self.question.text,
            "kind": self.question.kind,
            "heard": self.heard,
            "answer": self.answer,
            "ok": v.ok,
            "keyword": v.keyword,
            "english": v.english,
            "words": v.n_words,
            "looped": v.looped,
            "ttfa_ms": None if self.ttfa_ms is None else round(self.ttfa_ms, 1),
            "audio_ms": round(self.audio_ms),
            "segments_ms": self.segments_ms,
        }


async def ask(
    addr: str,
    questions: list[Question],
    rendered: dict[str, tuple[bytes, int]],
    args: argparse.Namespace,
) -> list[Turn]:
    """Ask ``questions`` in one session, each after the previous answer has played."""
    import websockets

    rate = args.input_rate
    frame = rate // 50  # 20 ms
    silence = b"\0\0" * frame
    turns: list[Turn] = []
    async with websockets.connect(f"ws://{addr}/v1/realtime", max_size=None) as ws:
        update = {"audio": {"input": {"format": {"type": "audio/pcm", "rate": rate}}}}
        await ws.send(json.dumps({"type": "session.update", "session": update}))

        async def reader() -> None:
            async for raw in ws:
                if isinstance(raw, bytes) or not turns:
                    continue
                now = time.perf_counter()
                ev = json.loads(raw)
                turn = turns[-1]
                kind = ev["type"]
                if kind == "error":
                    print("server error:", ev.get("error"))
                elif kind == "conversation.item.input_audio_transcription.completed":
                    turn.heard = f"{turn.heard} {ev.get('transcript', '')}".strip()
                elif kind == "response.created" and now >= turn.last_voice > 0:
                    turn.responses.add(ev["response"]["id"])
                elif kind == "response.done" and ev["response"]["id"] in turn.responses:
                    timing = ev["response"].get("timing") or {}
                    turn.segments_ms = dict(timing.get("segments_ms", {}))
                    turn.done.set()
                elif ev.get("response_id") not in turn.responses:
                    continue
                elif kind == "response.output_audio.delta":
                    if turn.first_audio is None:
                        turn.first_audio = now
                        turn.ttfa_ms = (now - turn.last_voice) * 1000
                    turn.audio_ms += len(base64.b64decode(ev["delta"])) / 2 / 24000 * 1000
                elif kind == "response.output_audio_transcript.done":
                    turn.answer = f"{turn.answer} {ev.get('transcript', '')}".strip()

        task = asyncio.create_task(reader())
        t = time.perf_counter()

        async def send(chunk: bytes) -> float:
            nonlocal t
            await ws.send(chunk)
            sent = time.perf_counter()
            t += 0.02
            await asyncio.sleep(max(0.0, t - time.perf_counter()))
            return sent

        for _ in range(50):  # 1 s of silence first
            await send(silence)
        for q in questions:
            pcm, last = rendered[q.text]
            turn = Turn(q)
            turns.append(turn)
            for off in range(0, len(pcm), frame * 2):
                sent = await send(pcm[off : off + frame * 2])
                if off // 2 <= last < off // 2 + frame:
                    turn.last_voice = sent
            deadline = time.perf_counter() + args.answer_timeout_s
            while not turn.done.is_set() and time.perf_counter() < deadline:
                await send(silence)
            if turn.first_audio is not None:  # let the answer play out, then 0.8 s more
                played = turn.first_audio + turn.audio_ms / 1000
                while time.perf_counter() < played:
                    await send(silence)
            for _ in range(40):
                await send(silence)
            if args.verbose:
                r = turn.row()
                mark = "ok " if r["ok"] else "BAD"
                print(f"  {mark} {r['question']!r} -> {r['answer']!r}", flush=True)
                print(f"      {r['ttfa_ms']} ms: {r['segments_ms']}", flush=True)
        task.cancel()
    return turns


def pct(vals: list[float], q: float) -> float | None:
    if not vals:
        return None
    ordered = sorted(vals)
    k = (len(ordered) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return round(ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo), 1)


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ttfa = [r["ttfa_ms"] for r in rows if r["ttfa_ms"] is not None]
    return {
        "turns": len(rows),
        "answers_ok_pct": round(100 * sum(r["ok"] for r in rows) / max(1, len(rows)), 1),
        "loops": sum(r["looped"] for r in rows),
        "mean_words": round(statistics.mean(r["words"] for r in rows), 1) if rows else 0.0,
        "not_english": sum(not r["english"] for r in rows),
        "ttfa_ms_p50": pct(ttfa, 50),
        "ttfa_ms_p90": pct(ttfa, 90),
        "no_answer": sum(r["answer"] == "" for r in rows),
    }


def one_run(args: argparse.Namespace) -> dict[str, Any]:
    from serverproc import running_server

    questions = list(QUESTIONS[: args.only] if args.only else QUESTIONS)
    rendered = render([q.text for q in questions], args.input_rate)
    with running_server(args.config) as (addr, _):
        load_before = os.getloadavg()[0]
        if args.fresh:
            turns = [t for q in questions for t in asyncio.run(ask(addr, [q], rendered, args))]
        else:
            turns = asyncio.run(ask(addr, questions, rendered, args))
    rows = [t.row() for t in turns]
    out = summarize(rows)
    out["loadavg_1m_before"] = round(load_before, 2)
    out["rows"] = rows
    for r in rows:
        mark = "ok " if r["ok"] else "BAD"
        print(f"{mark} {r['ttfa_ms'] or float('nan'):>7.1f} ms  {r['question']!r}")
        print(f"      heard {r['heard']!r}")
        print(f"      said  {r['answer']!r} ({r['words']} words)")
    keys = ("answers_ok_pct", "loops", "mean_words", "not_english", "ttfa_ms_p50", "ttfa_ms_p90")
    print("  ".join(f"{k}: {out[k]}" for k in keys))
    return out


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # serverproc
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "cpu.yaml")
    ap.add_argument("--runs", type=int, default=1, help="consecutive runs (median reported)")
    ap.add_argument("--fresh", action="store_true", help="a new session for each question")
    ap.add_argument("--only", type=int, default=0, help="ask only the first N questions")
    ap.add_argument("--input-rate", type=int, choices=(16000, 24000), default=16000)
    ap.add_argument("--answer-timeout-s", type=float, default=60.0)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--verbose", action="store_true", help="print each turn as it ends")
    args = ap.parse_args()
    runs = []
    for i in range(args.runs):
        print(f"--- run {i + 1} of {args.runs}, load average {os.getloadavg()[0]:.2f}")
        runs.append(one_run(args))
    out: dict[str, Any] = {"config": str(args.config), "fresh": args.fresh}
    for key in ("answers_ok_pct", "loops", "mean_words", "ttfa_ms_p50", "ttfa_ms_p90"):
        vals = [r[key] for r in runs if r[key] is not None]
        out[key] = statistics.median(vals) if vals else None
    out["runs"] = runs
    print(
        f"median of {len(runs)}: answers_ok_pct {out['answers_ok_pct']}, loops {out['loops']}, "
        f"mean words {out['mean_words']}, TTFA p50 {out['ttfa_ms_p50']} ms"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
