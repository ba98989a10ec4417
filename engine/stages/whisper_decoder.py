"""Whisper's decoding for the ASR stage: windows, batched encoder and decoder, loop guards.

Whisper is not streaming: it was trained on a fixed 30 s window, which costs about 0.7-0.9 s
on 2 cores whatever the utterance's length. CTranslate2's encoder takes a shorter window too,
and with enough padding after the speech Whisper transcribes it as well (``window: auto``:
the audio plus 3 s, rounded up to a whole second, at least 10 s: about 4x less work for a
short turn; windows under ~10 s make it repeat itself; narrowband audio decoded after its
context gets at least 15 s, see ``NARROW_CONTEXT_MIN_S``). A result that still looks like a
loop is decoded again in the full window. :class:`WhisperDecoder` transcribes several
utterances in one call (their mel windows stacked into one encoder batch, then decoded
together greedily by CTranslate2's batched ``generate``; one call per window size, so an
utterance gets the same words alone or in a batch). Utterances over 30 s are transcribed
alone with faster-whisper's own long-form loop.

Decoding is greedy (``beam_size=1``), without timestamps, without faster-whisper's own VAD
filter (the server already segments) and without conditioning on previous text; a window
judged silent (no-speech probability > 0.6 and average log-probability < -1, faster-whisper's
rule) transcribes to "". The stage around it (batching, audio preparation, the context
policy) is engine/stages/asr_whisper.py.

**Hums** (``hums``: the words of a listener's speech over an answer, for the interruption
decision). Whisper writes a hummed "mm-hm" as words, more so on a phone line: "in a mom.",
"Emga man.", "Amanda.", "I'm sorry." (Piper's "Mm-hmm." and a generated hum over G.711).
Such speech is checked against :data:`HUMS`: CTranslate2's ``align`` (the decoder's
probabilities of given text on the encoded window, which faster-whisper uses for word
timestamps) scores each hum and the decoded words, per token. When a hum fits well
(:data:`HUM_FIT`), nearly as well as the words (:data:`HUM_MARGIN`) and better than each of
the commonest interruptions (:data:`CUES`: "Wait.", "Stop.", "Hold on."), the hum is the
transcript. Measured on 8 kHz G.711 and 16 kHz audio of the turn-taking bench's clips and of
live Twilio trials: hums (and a door) scored -1.9 to -2.8 and within 1.8 of their words;
Piper's real interruptions ("wait", "no, stop", "hold on") and the human recordings, misheard
or not, scored -3.1 or lower ("It was the best of times." -3.26, within 0.1 of its words: the
margin is the absolute one). eSpeak NG's "Hold on." and "Wait." over G.711 did not: Whisper
heard "Fowl down" / "phone on" and "way", and "Mm-hmm." fit them at -2.88 and -2.99, within
the margin, so a real interruption was taken back as a hum (seen live, Twilio and WebRTC
with echo). They fit their cue far better (-1.26, -1.91); the hums, backchannels and noises
above kept their verdicts, their best cue 1.7-2.9 below the hum in live Twilio trials ("No."
is no cue: the generated hum fit it within 0.3 of "Mm-hmm."). The cost: one short decoder
pass per hum, per cue and for the words, on the window already encoded (~15 ms each on 2
cores), only for speech over an answer.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Literal, Protocol

import numpy as np
import numpy.typing as npt

log = logging.getLogger(__name__)

ASR_RATE = 16000
WINDOW_SAMPLES = 30 * ASR_RATE  # Whisper's fixed window
FRAMES_PER_S = 100  # mel frames (10 ms hop)
#: ``window: auto``: at least this much, and this much after the speech, rounded up to STEP.
#: The encoder's cost grows with the window (Whisper-base int8, 2 shared vCPUs: ~125 ms for
#: 10 s, ~160 ms for 12 s, ~220 ms for 15 s), so an 8 s turn gets 12 s rather than 15 s.
AUTO_MIN_S, AUTO_PAD_S, AUTO_STEP_S = 10, 3, 1
#: The least window for a turn decoded after its context when the audio is narrowband
#: (``narrowband``: telephone G.711 at 8 kHz, or any audio with nothing above 4 kHz).
#: Band-limited speech after a forced prefix in a 10-12 s window is misheard where the batch
#: route, decoding the whole recording in 15 s, hears it right (beckett.wav over mu-law:
#: "Failed better?" in 10-12 s, "Fail better." in 13 s and more). A minimum for all
#: narrowband turns would cost every short telephone turn ~60% more and changes the words of
#: short questions heard alone both ways ("water" -> "Walker"), so it is only for context.
NARROW_CONTEXT_MIN_S = 15
#: Narrowband: the share of the energy above NARROW_HZ under this (-50 dB). Speech
#: recorded at 16 kHz or more has 2e-3 to 6e-2 of it there; resampled 8 kHz audio under 2e-7.
NARROW_HZ, NARROW_SHARE = 4000.0, 1e-5
NO_SPEECH_PROB = 0.6  # faster-whisper's defaults for skipping a silent window
LOGPROB_FLOOR = -1.0
#: What a listener's hum is written as (``hums``; see the module docstring)
HUMS = ("Mm-hmm.", "Uh-huh.")
#: The commonest ways to interrupt: a hum must also fit better than each of them
#: (``hums``; see the module docstring)
CUES = ("Wait.", "Stop.", "Hold on.")
#: a hum is the transcript when its mean log-probability per token is at least HUM_FIT and
#: at most HUM_MARGIN below the decoded words'
HUM_FIT, HUM_MARGIN = -3.0, 2.0
#: Words a second a turn decoded after its context may hold; more is a decoding loop.
_MAX_WPS = 6.0
#: The previous turn (16 kHz float audio, its transcript), decoded before an utterance.
Context = tuple[npt.NDArray[np.float32], str]
#: Marks that end a phrase in a transcript (Latin, CJK and Arabic/Devanagari scripts).
_PHRASE_END = ".,;:!?\u2026\u3002\u3001\uff0c\uff01\uff1f\u061f\u0964"


def closed_phrase(text: str) -> str:
    """A previous turn's transcript as the forced prefix of the next turn's decoding: ended
    with a phrase mark if Whisper left it open. The VAD cut the two turns at a pause, so a
    phrase ends there; forced after open words ("ever tried", which Whisper writes for the
    same audio as "Ever tried." depending on ~50 ms of trailing silence), the decoder
    glues the next phrase onto the last word ("Everfile old." for "Ever failed.")."""
    text = text.strip()
    last = text.rstrip("\"')]\u00bb\u201d\u2019")[-1:]  # a closing quote or bracket after the mark
    return text + "." if last and last not in _PHRASE_END else text


def looks_looped(text: str, seconds: float) -> bool:
    """Whisper repeating itself: more than ``_MAX_WPS`` words a second, a phrase said again
    right after itself ("Fail again. Fail again."; a lone word three times), or ending with
    the start of the phrase before. A real
    repetition only costs a decode in the full window, whose result stands."""
    words = ["".join(c for c in w.lower() if c.isalnum() or c == "'") for w in text.split()]
    words = [w for w in words if w]
    if len(words) > _MAX_WPS * seconds + 2:
        return True
    for n in range(1, min(8, len(words) // 2) + 1):
        times = 3 if n == 1 else 2
        for i in range(len(words) - times * n + 1):
            if all(words[i + k * n : i + (k + 1) * n] == words[i : i + n] for k in range(times)):
                return True
    # a phrase of 4+ words, then the start (3+ words) of it again where the text stops (a
    # loop cut by the length cap): "it was the age of it was the age"
    for n in range(4, len(words)):
        for r in range(3, n):  # the text ends with the phrase words[i:i+n], then r of it
            i = len(words) - r - n
            if i >= 0 and words[i + n :] == words[i : i + r]:
                return True
    return False


def narrowband(audio: npt.NDArray[np.float32], rate: int = ASR_RATE) -> bool:
    """Is ``audio`` band-limited to 4 kHz (sampled at 8 kHz before, e.g. G.711)? Silence
    is not."""
    if audio.size < 2:
        return False
    power = np.abs(np.fft.rfft(audio.astype(np.float64))) ** 2
    total = float(power.sum())
    if total <= 0.0:
        return False
    high = float(power[np.fft.rfftfreq(audio.size, 1.0 / rate) > NARROW_HZ].sum())
    return high < NARROW_SHARE * total


def too_few_words(text: str, seconds: float) -> bool:
    """Fewer than a word a second over a turn of more than 1.5 s (speech runs at 2-3; the
    turn's quiet edges are already trimmed): after a forced context, the decoder stopped
    early ("It was" for 2.2 s of "It was the age of foolishness")."""
    return seconds > 1.5 and len(text.split()) < seconds


def window_frames(samples: int, window: Literal["auto", 30], least_s: int | None = None) -> int:
    """The encoder window (mel frames) for ``samples`` of 16 kHz audio: Whisper's full 30 s
    for ``window: 30``; for ``auto`` the audio plus ``AUTO_PAD_S``, rounded up to
    ``AUTO_STEP_S``, at least ``least_s`` seconds (default ``AUTO_MIN_S``)."""
    full = WINDOW_SAMPLES * FRAMES_PER_S // ASR_RATE
    if window != "auto":
        return full
    step = AUTO_STEP_S * FRAMES_PER_S
    need = samples * FRAMES_PER_S // ASR_RATE + AUTO_PAD_S * FRAMES_PER_S
    least = (AUTO_MIN_S if least_s is None else least_s) * FRAMES_PER_S
    return min(full, max(least, -(-need // step) * step))


class DecoderOptions(Protocol):
    """The options the decoder reads (the stage's ``WhisperOptions``)."""

    @property
    def window(self) -> Literal["auto", 30]: ...

    @property
    def min_samples(self) -> int: ...

    @property
    def beam_size(self) -> int: ...

    @property
    def language(self) -> str | None: ...

    @property
    def initial_prompt(self) -> str | None: ...


class WhisperDecoder:
    """Transcribes float32 mono 16 kHz audio with a loaded faster-whisper ``model``
    (worker thread; see the module docstring)."""

    def __init__(self, model: Any, options: DecoderOptions) -> None:
        self.model = model
        self.opts = options
        self._tokenizers: dict[str, Any] = {}

    def _tokenizer(self, language: str) -> Any:
        tok = self._tokenizers.get(language)
        if tok is None:
            from faster_whisper.tokenizer import Tokenizer

            m = self.model
            tok = Tokenizer(m.hf_tokenizer, m.model.is_multilingual, "transcribe", language)
            self._tokenizers[language] = tok
        return tok

    def transcribe(self, audio: npt.NDArray[np.float32], language: str) -> str:
        """Transcribe float32 mono 16 kHz audio (worker thread)."""
        return self.transcribe_batch([audio], [language])[0]

    def window_frames(self, samples: int, least_s: int | None = None) -> int:
        """The encoder window (mel frames) for ``samples``, at least ``least_s`` seconds
        (:func:`window_frames` under this decoder's ``window``)."""
        return window_frames(samples, self.opts.window, least_s)

    def transcribe_batch(
        self,
        audios: Sequence[npt.NDArray[np.float32]],
        languages: Sequence[str],
        contexts: Sequence[Context | None] | None = None,
        full_window: bool = False,
        hums: Sequence[bool] | None = None,
    ) -> list[str]:
        """Transcribe several utterances in batched encoder + decoder calls (one per window
        size, so an utterance gets the same words alone or in a batch).

        ``contexts[i]`` (the speaker's previous turn: its audio and transcript) is decoded
        before utterance ``i``: the previous words are the forced decoder prefix, and only
        the words after them are returned. A result that looks like a decoding loop (more
        than ``_MAX_WPS`` words a second) is transcribed again without context, and one
        from a short window again in the full window (``full_window``). ``hums[i]``:
        utterance ``i`` may be a listener's hum (:data:`HUMS`; checked when it is decoded
        without context in one window).
        """
        ctx: list[Context | None] = list(contexts) if contexts else [None] * len(audios)
        texts = [""] * len(audios)
        short: list[int] = []
        for i, audio in enumerate(audios):
            if audio.size < self.opts.min_samples:
                continue
            if audio.size > WINDOW_SAMPLES:
                texts[i] = self._transcribe_long(audio, languages[i])
            else:
                short.append(i)
                c = ctx[i]
                if c is not None and audio.size + c[0].size > WINDOW_SAMPLES:
                    ctx[i] = None  # no room for the context in one window
        full = WINDOW_SAMPLES * FRAMES_PER_S // ASR_RATE
        groups: dict[int, list[int]] = {}
        for i in short:
            c = ctx[i]
            size = audios[i].size + (c[0].size if c is not None else 0)
            least = NARROW_CONTEXT_MIN_S if c is not None and narrowband(audios[i]) else None
            frames = full if full_window else self.window_frames(size, least)
            groups.setdefault(frames, []).append(i)
        for frames, items in groups.items():
            self._decode(audios, languages, ctx, items, frames, texts, hums)
        return texts

    def _decode(
        self,
        audios: Sequence[npt.NDArray[np.float32]],
        languages: Sequence[str],
        ctx: Sequence[Context | None],
        short: list[int],
        frames: int,
        texts: list[str],
        hums: Sequence[bool] | None = None,
    ) -> None:
        """One batched call for the utterances ``short`` in a window of ``frames``; their
        transcripts go to ``texts``."""
        m = self.model
        from faster_whisper.audio import pad_or_trim

        windows = []
        content: list[int] = []  # each utterance's mel frames in its window
        for i in short:
            c = ctx[i]
            audio = audios[i] if c is None else np.concatenate([c[0], audios[i]])
            feats = m.feature_extractor(audio)
            windows.append(pad_or_trim(feats[:, : feats.shape[-1] - 1], frames))
            content.append(max(1, min(frames, feats.shape[-1] - 1)))
        short_window = frames < WINDOW_SAMPLES * FRAMES_PER_S // ASR_RATE
        encoded = m.encode(np.stack(windows).astype(np.float32))
        prompts = []
        tokenizers = []
        prefixes: list[list[int]] = []
        for i in short:
            tok = self._tokenizer(self.opts.language or languages[i])
            hint = self.opts.initial_prompt
            previous = tok.encode(" " + hint.strip()) if hint else []
            c = ctx[i]
            prefix = closed_phrase(c[1]) if c is not None else ""
            prompts.append(
                m.get_prompt(tok, previous, without_timestamps=True, prefix=prefix or None)
            )
            prefixes.append(tok.encode(" " + prefix) if prefix else [])
            tokenizers.append(tok)
        from faster_whisper.transcribe import get_suppressed_tokens

        max_length = m.max_length
        if all(prefixes) or short_window:  # cap the decoding, so a loop (Whisper repeating
            # itself after a forced prefix or in a short window) stops early and costs little
            # before the loop guard decodes the turn again (alone, or in the full window)
            budget = max(
                len(p) + int(_MAX_WPS * 2 * audios[i].size / ASR_RATE) + 12
                for i, p in zip(short, prompts, strict=True)
            )
            max_length = min(max_length, budget)
        results = m.model.generate(
            encoded,
            prompts,
            beam_size=self.opts.beam_size,
            max_length=max_length,
            return_scores=True,
            return_no_speech_prob=True,
            suppress_blank=True,
            suppress_tokens=get_suppressed_tokens(tokenizers[0], [-1]),
        )
        retry: list[int] = []
        again_full: list[int] = []
        for i, tok, pre, res in zip(short, tokenizers, prefixes, results, strict=True):
            tokens = res.sequences_ids[0]
            if pre:
                if tokens[: len(pre)] != pre:
                    retry.append(i)
                    continue
                tokens = tokens[len(pre) :]
            avg_logprob = res.scores[0] * len(tokens) / (len(tokens) + 1)
            if not pre and res.no_speech_prob > NO_SPEECH_PROB and avg_logprob < LOGPROB_FLOOR:
                continue  # a silent window
            text = tok.decode(tokens).strip()
            if pre:  # the previous turn's closing punctuation may open the continuation
                text = text.lstrip(" .,;:!?")
            seconds = audios[i].size / ASR_RATE
            if pre and (not text or looks_looped(text, seconds) or too_few_words(text, seconds)):
                # a loop after the context, or the context swallowed this turn's words (a
                # wrong previous transcript forced as the prefix, or the decoder ending
                # right after it: the new audio taken for the context's words again; a
                # silent turn costs one more decode then): decode this turn alone
                # (in its own short window first: ~0.3 s, vs ~1.2 s for 30 s with context)
                retry.append(i)
                continue
            if short_window and looks_looped(text, seconds):
                again_full.append(i)  # a loop in a short window: decode it in 30 s
                continue
            texts[i] = text
        if hums is not None:
            check = [j for j, i in enumerate(short) if hums[i] and not ctx[i] and texts[i]]
            if check:
                fits = self._hums(
                    encoded, content, [tokenizers[j] for j in check], check, short, texts
                )
                for i, hum in fits.items():
                    texts[i] = hum
        if retry:
            again = self.transcribe_batch(
                [audios[i] for i in retry],
                [languages[i] for i in retry],
            )
            for i, text in zip(retry, again, strict=True):
                texts[i] = text
        if again_full:  # with the same context, in the full window
            again = self.transcribe_batch(
                [audios[i] for i in again_full],
                [languages[i] for i in again_full],
                [ctx[i] for i in again_full],
                full_window=True,
            )
            for i, text in zip(again_full, again, strict=True):
                texts[i] = text

    def _hums(
        self,
        encoded: Any,
        content: list[int],
        tokenizers: list[Any],
        check: list[int],
        short: list[int],
        texts: list[str],
    ) -> dict[int, str]:
        """Of the utterances at batch positions ``check`` (their words in ``texts``), those
        that fit a hum (:data:`HUMS`, :data:`HUM_FIT`, :data:`HUM_MARGIN`, better than every
        :data:`CUES`), with the hum."""
        out: dict[int, str] = {}
        by_sot: dict[tuple[int, ...], list[int]] = {}
        for j, tok in zip(check, tokenizers, strict=True):
            by_sot.setdefault(tuple(tok.sot_sequence), []).append(j)
        size = len(short)
        for sot, positions in by_sot.items():
            tok = tokenizers[check.index(positions[0])]
            hum_ids = [tok.encode(" " + h) for h in HUMS]
            own = [hum_ids[0]] * size  # (the rows not checked: any text, ignored)
            for j in positions:
                own[j] = tok.encode(" " + texts[short[j]].strip())
            words = self._fit(encoded, sot, own, content)
            best = [(float("-inf"), "")] * size
            for hum, ids in zip(HUMS, hum_ids, strict=True):
                for j, fit in enumerate(self._fit(encoded, sot, [ids] * size, content)):
                    best[j] = max(best[j], (fit, hum))
            cue = [(float("-inf"), "")] * size
            for text in CUES:
                ids = tok.encode(" " + text)
                for j, fit in enumerate(self._fit(encoded, sot, [ids] * size, content)):
                    cue[j] = max(cue[j], (fit, text))
            for j in positions:
                fit, hum = best[j]
                taken = fit >= HUM_FIT and fit >= words[j] - HUM_MARGIN and fit > cue[j][0]
                if taken:
                    out[short[j]] = hum
                log.debug(
                    "%s: hum %r %.2f, words %r %.2f, cue %r %.2f",
                    "a hum" if taken else "words",
                    hum,
                    fit,
                    texts[short[j]],
                    words[j],
                    cue[j][1],
                    cue[j][0],
                )
        return out

    def _fit(
        self, encoded: Any, sot: tuple[int, ...], tokens: list[list[int]], content: list[int]
    ) -> list[float]:
        """How well each row's ``tokens`` fit its encoded window: their mean log-probability
        per token under the decoder (CTranslate2's ``align``)."""
        results = self.model.model.align(encoded, list(sot), tokens, content)
        return [
            float(np.mean(np.log(np.maximum(np.asarray(r.text_token_probs), 1e-9))))
            if len(r.text_token_probs)
            else float("-inf")
            for r in results
        ]

    def _transcribe_long(self, audio: npt.NDArray[np.float32], language: str) -> str:
        segments, _info = self.model.transcribe(
            audio,
            language=self.opts.language or language,
            task="transcribe",
            beam_size=self.opts.beam_size,
            best_of=1,
            temperature=0.0,
            without_timestamps=True,
            vad_filter=False,
            condition_on_previous_text=False,
            initial_prompt=self.opts.initial_prompt,
        )
        return " ".join(seg.text.strip() for seg in segments).strip()
