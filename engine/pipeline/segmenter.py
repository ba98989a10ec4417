"""Split streaming LLM text into speakable TTS segments (pure: no I/O, no clock).

:class:`Segmenter` takes text deltas as they stream out of the LLM and returns complete
segments for the TTS stage:

- The **first** segment is released early for low time-to-first-audio: at the first clause
  boundary (``, ; : . ! ? …``, a dash, or a newline) once it holds ``first_min_words`` words,
  or after ``first_max_words`` words, whichever comes first.
- **Later** segments are sentence-sized (``. ! ? …`` or a newline), or forced once they hold
  ``max_words`` words: at the last clause boundary in the second half of the segment if there
  is one, otherwise right after the ``max_words``-th word.

Words are runs of non-whitespace characters. A segment is only ever cut *between* words, and
only once the next word has started (its first character arrived), because until then the
last word may still grow: ``"3"`` may become ``"3.5"``, ``"Dr."`` may be followed by a name.
So a number such as ``3.5`` or ``1,000`` is never split (its punctuation is inside a word), and
punctuation only ends a clause when whitespace follows it. Common abbreviations (``Dr.``,
``Mr.``, ``e.g.``, ``i.e.``, ``U.S.``, initials like ``J.``) are not sentence ends, and
neither is ``2.`` as the first word of a segment (a list marker after a newline).

Whitespace is preserved: each segment carries the whitespace that follows it (and the first
one any leading whitespace), so ``"".join(segments) == text`` for every chunking of the
text, and every segment holds at least one word unless the whole text is whitespace.
Segmentation does not depend on how the text was chunked: streaming gives the same segments
as pushing the whole text at once.

:class:`SentenceStop` uses the same sentence rule to end a spoken answer after its n-th
sentence (``engine.prompt.spoken_max_sentences``).

A segment that ends in whitespace-only tokens (``"\\n\\n"`` as its own LLM token) is released
with the next token that starts a word, or by :meth:`Segmenter.flush` at the end.
"""

from __future__ import annotations

import re
from enum import IntEnum

from engine.config import SegmenterConfig

__all__ = ["Segmenter", "SentenceStop"]

_TOKEN_RE = re.compile(r"\s+|\S+")
# Characters that may trail the punctuation of a boundary: closing quotes, brackets, markdown.
_EM_DASH, _EN_DASH = "\u2014", "\u2013"
_CLOSERS = "\"')]}*_`\u00bb\u201d\u2019"  # quotes (also curly), brackets, markdown
_OPENERS = "\"'([{*_`\u00ab\u201c\u2018"
_SENTENCE_END = frozenset(".!?\u2026")  # ... and the ellipsis character
_CLAUSE_END = frozenset({",", ";", ":", _EM_DASH, _EN_DASH})
_DASHES = frozenset({"-", "--", _EM_DASH, _EN_DASH})
_ABBREVIATIONS = frozenset(
    {"mr.", "mrs.", "ms.", "dr.", "prof.", "sr.", "jr.", "st.", "vs.", "mt.", "fig.", "approx."}
)
_DOTTED_ABBREVIATION_RE = re.compile(r"(?:[A-Za-z]\.){2,}|[A-Z]\.")  # e.g. i.e. U.S. J.
_LIST_MARKER_RE = re.compile(r"\d{1,3}\.")  # "1." starting a numbered list item


class _Boundary(IntEnum):
    NONE = 0
    CLAUSE = 1
    SENTENCE = 2


def _boundary_after(word: str, space: str, *, leading: bool) -> _Boundary:
    """What kind of boundary lies after ``word`` when the whitespace ``space`` follows it.

    ``leading``: the word is the first of its segment, where ``2.`` is a list marker.
    """
    if "\n" in space:
        return _Boundary.SENTENCE
    core = word.rstrip(_CLOSERS)
    if not core:
        return _Boundary.NONE
    if core in _DASHES:
        return _Boundary.CLAUSE
    last = core[-1]
    if last in _SENTENCE_END:
        bare = core.lstrip(_OPENERS)
        if (
            bare.lower() in _ABBREVIATIONS
            or _DOTTED_ABBREVIATION_RE.fullmatch(bare)
            or (leading and _LIST_MARKER_RE.fullmatch(bare))
        ):
            return _Boundary.NONE
        return _Boundary.SENTENCE
    if last in _CLAUSE_END:
        return _Boundary.CLAUSE
    return _Boundary.NONE


class Segmenter:
    """Streaming text segmenter for one response; reusable after :meth:`flush`.

    ``early_first=False``: no early first segment, every segment is sentence-sized (a text
    known whole, batch speech: a clause spoken alone is followed by the TTS's pause, in the
    middle of a sentence)."""

    def __init__(self, config: SegmenterConfig, *, early_first: bool = True) -> None:
        self._config = config
        self._early_first = early_first
        self._buf = ""
        self._first = early_first

    @property
    def pending(self) -> str:
        """Text received but not yet returned in a segment."""
        return self._buf

    def push(self, delta: str) -> list[str]:
        """Add a text delta; return the segments it completed (possibly none), in order."""
        if not delta:
            return []
        self._buf += delta
        out: list[str] = []
        while (cut := self._find_cut()) is not None:
            out.append(self._buf[:cut])
            self._buf = self._buf[cut:]
            self._first = False
        return out

    def flush(self) -> list[str]:
        """End of stream: return the remaining text as a last segment and reset."""
        rest = self._buf
        self.reset()
        return [rest] if rest else []

    def reset(self) -> None:
        """Drop pending text (a cancelled response) and start a new stream."""
        self._buf = ""
        self._first = self._early_first

    def _find_cut(self) -> int | None:
        """Index in the buffer where the next segment ends, or None if none is ready yet.

        The decision for a word only looks at that word, the whitespace after it, and the words
        before it, and is only taken once the next word has started; that is what makes the
        result independent of chunking.
        """
        cfg = self._config
        tokens = _TOKEN_RE.findall(self._buf)
        pos = 0
        words = 0
        clause_cut: int | None = None
        clause_words = 0
        for i, token in enumerate(tokens):
            pos += len(token)
            if token.isspace():
                continue
            words += 1
            if i + 2 >= len(tokens):
                return None  # this word may still grow, or the next one has not started
            space = tokens[i + 1]
            cut = pos + len(space)
            kind = _boundary_after(token, space, leading=words == 1)
            if self._first:
                if kind is not _Boundary.NONE and words >= cfg.first_min_words:
                    return cut
                if words >= cfg.first_max_words:
                    return cut
                continue
            if kind is _Boundary.SENTENCE:
                return cut
            if kind is _Boundary.CLAUSE:
                clause_cut, clause_words = cut, words
            if words >= cfg.max_words:
                if clause_cut is not None and 2 * clause_words >= cfg.max_words:
                    return clause_cut
                return cut
        return None


class SentenceStop:
    """Ends a spoken answer after its ``sentences``-th sentence, and keeps it within ``words``
    words past its first sentence (pure: the pipeline's).

    The first sentence passes through as it comes (the first audio waits for it). With
    ``words``, each later sentence is held until it ends and passed on only if the answer
    then has at most ``words`` words; one that runs past is dropped, and the answer ends
    before it. A sentence ends at the whitespace after its last word (the segmenter's rule:
    ``. ! ? …`` not in an abbreviation, or a newline), so numbers stay whole (``"3."`` then
    ``"5"`` is ``3.5``); :attr:`stopped` is set once the answer is complete. At the end of
    the text, :meth:`flush` gives what is still held.

    A list is one sentence: the newline after a line that starts with a list marker
    (``1.``, ``-``, ``*``, ``•``) ends a sentence only if the next line is not another item,
    so "Count to five" is not cut after "1. One 2. Two". What follows such a newline is held
    until the next line's first word is read.
    """

    def __init__(self, sentences: int, words: int | None = None) -> None:
        if sentences < 1 or (words is not None and words < 1):
            raise ValueError(f"sentences and words must be >= 1, got {sentences}, {words}")
        self._max = sentences
        self._budget = words
        self._done = 0  # sentences ended
        self._words = 0  # whole words so far
        self._word = ""  # the word being read (no whitespace yet after it)
        self._leading = True  # it is the first word of the answer or of a line
        self._item = False  # the line being read is a list item
        self._after_item = False  # a list item's line ended: does the list go on?
        self._pending = ""  # what came after that newline, until the next line's first word
        self._held = ""  # the sentence being read after the first (with ``words``)
        self.stopped = False

    def push(self, delta: str) -> str:
        """The part of ``delta`` to pass on (``""`` once stopped)."""
        if self.stopped:
            return ""
        out: list[str] = []
        for ch in delta:
            if ch.isspace() and self._word:
                word, self._word = self._word, ""
                self._words += 1
                if self._leading:
                    self._item = _is_item_marker(word)
                if self._after_item:  # the first word of the line after a list item
                    self._after_item = False
                    pending, self._pending = self._pending, ""
                    if not self._item and self._end_sentence(out):
                        return "".join(out)  # the list ended the answer: this line is not spoken
                    self._emit(pending, out)
                if self._holding and self._budget is not None and self._words > self._budget:
                    self.stopped = True  # this sentence runs past the budget: not spoken
                    return "".join(out)
                if _boundary_after(word, ch, leading=self._leading) is _Boundary.SENTENCE:
                    if ch == "\n" and self._item:
                        self._after_item = True  # the list may go on on the next line
                    elif self._end_sentence(out):
                        return "".join(out)
                self._leading = False
            elif not ch.isspace():
                self._word += ch
            if ch == "\n":
                self._leading = True
            self._emit(ch, out)
        return "".join(out)

    def flush(self) -> str:
        """The end of the answer: a held last sentence, if it fits the budget."""
        if self.stopped:
            return ""
        self.stopped = True
        words = self._words + (1 if self._word else 0)
        out: list[str] = []
        if self._after_item:  # the text ended on the line after a list item
            self._after_item = False
            pending, self._pending = self._pending, ""
            if self._word and not _is_item_marker(self._word) and self._end_sentence(out):
                return "".join(out)
            self._emit(pending, out)
        if self._budget is not None and words > self._budget:
            return "".join(out)
        held, self._held = self._held, ""
        return "".join(out) + held

    def _end_sentence(self, out: list[str]) -> bool:
        """A sentence ended (within the budget: spoken); True if that ends the answer."""
        self._done += 1
        out.append(self._held)
        self._held = ""
        if self._done >= self._max:
            self.stopped = True
            return True
        return False

    def _emit(self, text: str, out: list[str]) -> None:
        """Text read: held while a list may go on or a later sentence is being read."""
        if self._after_item:
            self._pending += text
        elif self._holding:
            self._held += text
        else:
            out.append(text)

    @property
    def _holding(self) -> bool:
        return self._budget is not None and self._done >= 1


_ITEM_BULLETS = frozenset({"-", "*", "\u2022", "+"})


def _is_item_marker(word: str) -> bool:
    """``word`` starts a list item when it starts a line: ``1.``, ``-``, ``*``, ``•``."""
    return word in _ITEM_BULLETS or bool(_LIST_MARKER_RE.fullmatch(word))
