"""The labelled turn set of bench/turn_end.py: real speech, labelled by construction.

Utterances: the human recordings the project ships (tests/data/beckett.wav's six phrases,
tests/data/two_cities.wav's sentence and its four clauses; tests/data/README.md) and
tests/data/questions.wav's three questions (Piper, synthetic), and :data:`SENTENCES` spoken by
the project's two TTS voices, rendered in this process by the engine's own stages (Piper:
engine/stages/tts_piper.py, noise scales 0 so it renders the same every time; eSpeak NG:
engine/stages/tts_espeak.py). Word times come from faster-whisper's word timestamps with
the Whisper-base model the engine ships (engine/models.py's ``whisper_base_dir``); each word
boundary is moved to the quietest 10 ms between the two words (Whisper's times are +-0.1 s).
The utterances and their words are cached under .cache/turn_end/ (gitignored).

Each utterance gives three turns (a seeded choice of boundary and pause length):

* ``complete``: the whole utterance;
* ``cut``: the utterance stopped at a word boundary mid-sentence (at least one word and,
  where the utterance allows, MIN_CUT_S of it kept; at least one word dropped): the
  speaker stops and would go on;
* ``paused``: a hesitation (0.4-1.2 s of silence) inserted at a word boundary, then the
  rest of the utterance.

Every turn is 16 kHz float32: LEAD_S of quiet, the speech at one level (the loud part's RMS
0.1), then TAIL_S of quiet; the quiet is light noise (-60 dBFS), laid over the whole turn,
not digital silence. ``speech_end_s`` is the last voiced sample (10 ms RMS above 5 % of the
utterance's loudest), where a complete turn is over; a detector that ends a turn before its
``speech_end_s`` cut the speaker off.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import numpy.typing as npt
import soundfile as sf
import soxr

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
CACHE = ROOT / ".cache" / "turn_end"
RATE = 16000
LEAD_S = 0.3
#: quiet after the speech: the brief's 2 s plus room for semantic_vad low's 3 s longest wait
TAIL_S = 4.0
NOISE_RMS = 0.001  # -60 dBFS
SPEECH_RMS = 0.1
PAUSE_S = (0.4, 1.2)
FADE = RATE // 200  # 5 ms at each edge of a cut
MIN_CUT_S = 0.3
VERSION = 2
WORD_PAD_S = 0.5

Kind = Literal["complete", "cut", "paused"]
KINDS: tuple[Kind, ...] = ("complete", "cut", "paused")
F32 = npt.NDArray[np.float32]

#: (file, start s, end s, words): human recordings (and questions.wav, Piper's)
HUMAN = [
    ("beckett.wav", 0.25, 1.35, "Ever tried."),
    ("beckett.wav", 1.75, 3.00, "Ever failed."),
    ("beckett.wav", 3.35, 4.35, "No matter."),
    ("beckett.wav", 4.80, 5.75, "Try again."),
    ("beckett.wav", 6.55, 7.55, "Fail again."),
    ("beckett.wav", 8.05, 9.05, "Fail better."),
    ("two_cities.wav", 0.0, 7.95, "It was the best of times, ... the age of foolishness."),
    ("two_cities.wav", 0.35, 2.25, "It was the best of times,"),
    ("two_cities.wav", 2.30, 4.30, "it was the worst of times,"),
    ("two_cities.wav", 4.40, 5.90, "it was the age of wisdom,"),
    ("two_cities.wav", 6.00, 7.95, "it was the age of foolishness."),
    ("questions.wav", 0.2, 2.4, "What is the capital of Germany?"),
    ("questions.wav", 2.9, 5.5, "What color is grass?"),
    ("questions.wav", 6.0, 9.5, "Thank you. Goodbye!"),
]
#: what the TTS voices say: questions, requests and statements of 3-16 words
SENTENCES = [
    "What is the capital of France?",
    "Can you tell me how far it is to the station?",
    "I would like to book a table for two people tonight.",
    "How many legs does a spider have?",
    "Please remind me to call my mother tomorrow morning.",
    "What time does the pharmacy on the corner close?",
    "My flight was cancelled, so I need a new ticket.",
    "Could you play some quiet music for the kids?",
    "Why is the sky blue during the day but red at sunset?",
    "Turn off the lights in the kitchen.",
    "I think the meeting starts at half past nine.",
    "What's the weather going to be like this weekend?",
    "Tell me a short story about a dragon who learns to sing.",
    "How do I get a coffee stain out of a white shirt?",
    "The package should have arrived on Tuesday, but it never came.",
    "Set a timer for fifteen minutes.",
    "Who wrote the novel about the white whale?",
    "Can you explain how a rainbow forms?",
    "I need three apples, a loaf of bread and some milk.",
    "What is twelve times eight?",
    "Send a message to Anna saying I will be late.",
    "Is it going to rain in London tomorrow afternoon?",
    "Translate good morning into Spanish, please.",
    "When did the first person walk on the moon?",
    "My phone keeps restarting whenever I open the camera.",
    "Which planet is the largest in our solar system?",
    "Let me think about that and get back to you.",
    "How long should I boil an egg for a soft yolk?",
    "Add olive oil and garlic to my shopping list.",
    "What are the opening hours of the museum on Sundays?",
    "I was wondering whether you could help me with my homework.",
    "Do you know a good recipe for vegetable soup?",
    "The train was late again, and I missed the bus.",
    "What does the word ephemeral mean?",
    "Call the dentist and move my appointment to Friday.",
    "How many people live in Tokyo?",
]
VOICES = ("piper", "espeak")


@dataclass(frozen=True)
class Word:
    text: str
    start: float  # s, in the utterance
    end: float


@dataclass(frozen=True)
class Utterance:
    name: str  # source:text
    source: str  # human, piper, espeak
    text: str
    audio: F32  # 16 kHz, at SPEECH_RMS, trimmed to its speech with ~50 ms margins
    words: tuple[Word, ...]
    #: (i, s): the boundary after word i, moved to the quietest 10 ms between it and word i + 1
    boundaries: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class Turn:
    name: str
    kind: Kind
    source: str
    text: str  # what is said in it (a cut turn: the words kept)
    audio: F32  # 16 kHz float32, with LEAD_S before the speech and TAIL_S after it
    speech_end_s: float  # last voiced sample: the speech is over here
    pause_at_s: float | None = None  # paused: where the inserted silence starts ...
    pause_s: float | None = None  # ... and how long it is
    cut_at_s: float | None = None  # cut: where the speech was cut


def _rms10(x: F32) -> npt.NDArray[np.float64]:
    """RMS over 10 ms around each sample."""
    win = RATE // 100
    return np.sqrt(np.convolve(x.astype(np.float64) ** 2, np.ones(win) / win, mode="same"))


def voiced(x: F32, ref: float | None = None) -> tuple[int, int]:
    """First and last voiced sample: 10 ms RMS above 5 % of ``ref`` (default: x's loudest)."""
    rms = _rms10(x)
    idx = np.nonzero(rms > 0.05 * (rms.max() if ref is None else ref))[0]
    if idx.size == 0:
        return 0, 0
    return int(idx[0]), int(idx[-1])


def _level(x: F32) -> F32:
    loud = x[np.abs(x) > 0.05 * np.max(np.abs(x))]
    return np.asarray(x / (np.sqrt(np.mean(loud**2)) + 1e-9) * SPEECH_RMS, dtype=np.float32)


def _trim(x: F32) -> F32:
    first, last = voiced(x)
    margin = RATE // 20
    return x[max(0, first - margin) : last + margin]


def boundary(x: F32, left: Word, right: Word) -> float:
    """The quietest 10 ms (s) between two words, searched 80 ms around Whisper's times."""
    lo = max(0.0, min(left.end, right.start) - 0.08)
    hi = min(len(x) / RATE, max(left.end, right.start) + 0.08)
    lo = max(lo, (left.start + left.end) / 2)  # never before the middle of either word
    hi = min(hi, (right.start + right.end) / 2)
    a, b = int(lo * RATE), int(hi * RATE)
    if b <= a:
        return (left.end + right.start) / 2
    rms = _rms10(x)[a:b]
    return (a + int(np.argmin(rms))) / RATE


def _render(whisper: object) -> list[Utterance]:
    """Every utterance: the recordings, then each sentence in each voice."""
    sys.path.insert(0, str(ROOT))
    from engine.stages.tts_espeak import EspeakOptions, EspeakTts
    from engine.stages.tts_piper import PiperOptions, PiperTts

    raw: list[tuple[str, str, F32]] = []
    piper = PiperTts(PiperOptions(threads=1, noise_scale=0.0, noise_w_scale=0.0), "turn-end")
    piper.load()
    espeak = EspeakTts(EspeakOptions(), "turn-end-espeak")
    espeak.load()
    for text in SENTENCES:
        y = np.concatenate(list(piper.synthesize(text, speed=1.0)))
        raw.append(("piper", text, np.asarray(soxr.resample(y, piper.native_rate, RATE))))
        pcm = espeak.synthesize(text, speed=1.0, keep_going=lambda: True)
        y = np.frombuffer(pcm, "<i2").astype(np.float32) / 32768.0
        raw.append(("espeak", text, np.asarray(soxr.resample(y, espeak.native_rate, RATE))))
    return human(whisper, [h[3] for h in HUMAN]) + [
        prepare(source, text, x, whisper) for source, text, x in raw
    ]


def prepare(source: str, text: str, x: F32, whisper: object) -> Utterance:
    """An utterance from raw speech: levelled, trimmed, its words and boundaries found."""
    x = _trim(_level(np.asarray(x, dtype=np.float32)))
    words = transcribe_words(whisper, x)
    bounds = tuple((i, boundary(x, words[i], words[i + 1])) for i in range(len(words) - 1))
    return Utterance(f"{source}:{text}", source, text, x, words, bounds)


def human(whisper: object, texts: list[str]) -> list[Utterance]:
    """The recordings of :data:`HUMAN` with these texts (fast: no TTS)."""
    out = []
    for file, start, end, text in HUMAN:
        if text in texts:
            x, rate = sf.read(DATA / file, dtype="float32")
            source = "piper" if file == "questions.wav" else "human"
            out.append(prepare(source, text, x[int(start * rate) : int(end * rate)], whisper))
    return out


def whisper_model() -> object:
    """Whisper-base as the engine loads it (engine/stages/asr_whisper.py), one CPU thread."""
    sys.path.insert(0, str(ROOT))
    from faster_whisper import WhisperModel

    from engine.models import whisper_base_dir

    return WhisperModel(
        str(whisper_base_dir()),
        device="cpu",
        compute_type="int8",
        cpu_threads=1,
        local_files_only=True,
    )


def transcribe_words(whisper: object, x: F32) -> tuple[Word, ...]:
    """The words of ``x`` and their times (s), Whisper hearing it with WORD_PAD_S of quiet
    on both sides (on a clip that starts at its first word, Whisper puts that word at 0 and
    stretches it)."""
    pad = np.zeros(int(WORD_PAD_S * RATE), np.float32)
    segments, _ = whisper.transcribe(  # type: ignore[attr-defined]
        np.concatenate([pad, x, pad]),
        language="en",
        word_timestamps=True,
        beam_size=1,
        condition_on_previous_text=False,
    )
    dur = len(x) / RATE
    return tuple(
        Word(w.word.strip(), _clamp(w.start - WORD_PAD_S, dur), _clamp(w.end - WORD_PAD_S, dur))
        for s in segments
        for w in s.words or []
    )


def _clamp(t: float, dur: float) -> float:
    return round(min(max(float(t), 0.0), dur), 3)


def _key() -> str:
    spec = json.dumps([VERSION, HUMAN, SENTENCES, VOICES])
    return hashlib.sha256(spec.encode()).hexdigest()[:12]


def utterances(cache: Path = CACHE) -> list[Utterance]:
    """Every utterance of the set with its words, rendered once and cached."""
    path = cache / f"utterances-{_key()}"
    meta_path, audio_path = path.with_suffix(".json"), path.with_suffix(".npz")
    if meta_path.is_file() and audio_path.is_file():
        meta = json.loads(meta_path.read_text())
        with np.load(audio_path) as arrays:
            return [
                Utterance(
                    m["name"],
                    m["source"],
                    m["text"],
                    np.asarray(arrays[f"a{i}"], dtype=np.float32),
                    tuple(Word(*w) for w in m["words"]),
                    tuple((int(i_), float(s)) for i_, s in m["boundaries"]),
                )
                for i, m in enumerate(meta)
            ]
    utts = _render(whisper_model())
    cache.mkdir(parents=True, exist_ok=True)
    np.savez(audio_path, **{f"a{i}": u.audio for i, u in enumerate(utts)})
    meta = [
        {
            "name": u.name,
            "source": u.source,
            "text": u.text,
            "words": [[w.text, w.start, w.end] for w in u.words],
            "boundaries": [list(b) for b in u.boundaries],
        }
        for u in utts
    ]
    meta_path.write_text(json.dumps(meta, indent=1))
    return utts


def _fade(x: F32, n: int, out: bool) -> F32:
    if x.size < n or n <= 0:
        return x
    y = x.copy()
    ramp = np.linspace(1.0, 0.0, n, dtype=np.float32)
    if out:
        y[-n:] *= ramp
    else:
        y[:n] *= ramp[::-1]
    return y


def _place(speech: F32, rng: np.random.Generator, ref: float) -> tuple[F32, float]:
    """Lead + speech + tail, light noise over all of it; and the speech's end (s)."""
    lead, tail = int(LEAD_S * RATE), int(TAIL_S * RATE)
    x = np.concatenate([np.zeros(lead, np.float32), speech, np.zeros(tail, np.float32)])
    _, last = voiced(x, ref)
    noise = rng.normal(0.0, NOISE_RMS, x.size).astype(np.float32)
    return (x + noise).astype(np.float32), last / RATE


def complete_turn(u: Utterance, seed: int) -> Turn:
    """The whole utterance."""
    ref = float(_rms10(u.audio).max())
    audio, end = _place(u.audio, np.random.default_rng(seed), ref)
    return Turn(f"complete|{u.name}", "complete", u.source, u.text, audio, end)


def cut_turn(u: Utterance, b: int, seed: int) -> Turn:
    """The utterance stopped at its boundary ``b`` (after word ``u.boundaries[b][0]``)."""
    ref = float(_rms10(u.audio).max())
    i, at = u.boundaries[b]
    kept = " ".join(w.text for w in u.words[: i + 1])
    speech = _fade(u.audio[: int(at * RATE)], FADE, out=True)
    audio, end = _place(speech, np.random.default_rng(seed), ref)
    return Turn(f"cut|{u.name}", "cut", u.source, kept, audio, end, cut_at_s=LEAD_S + at)


def paused_turn(u: Utterance, b: int, pause_s: float, seed: int) -> Turn:
    """The utterance with ``pause_s`` of silence inserted at its boundary ``b``."""
    ref = float(_rms10(u.audio).max())
    cut = int(u.boundaries[b][1] * RATE)
    gap = np.zeros(int(pause_s * RATE), np.float32)
    speech = np.concatenate(
        [_fade(u.audio[:cut], FADE, out=True), gap, _fade(u.audio[cut:], FADE, out=False)]
    )
    audio, end = _place(speech, np.random.default_rng(seed), ref)
    at = LEAD_S + cut / RATE
    return Turn(f"paused|{u.name}", "paused", u.source, u.text, audio, end, at, pause_s)


def turns_of(u: Utterance, rng: random.Random, seed: int) -> list[Turn]:
    """The three turns of one utterance (a cut and a pause at seeded word boundaries)."""
    out = [complete_turn(u, seed)]
    if u.boundaries:
        # a cut keeps at least MIN_CUT_S of speech where it can (less never starts a turn)
        cuts = [b for b, (_, at) in enumerate(u.boundaries) if at >= MIN_CUT_S]
        out.append(cut_turn(u, rng.choice(cuts or [len(u.boundaries) - 1]), seed))
        b = rng.randrange(len(u.boundaries))
        out.append(paused_turn(u, b, round(rng.uniform(*PAUSE_S), 2), seed))
    return out


def build(seed: int = 1, utts: list[Utterance] | None = None) -> list[Turn]:
    """The labelled turn set (deterministic for a seed)."""
    rng = random.Random(seed)
    out: list[Turn] = []
    for n, u in enumerate(utterances() if utts is None else utts):
        out += turns_of(u, rng, seed * 100_003 + n)
    return out
