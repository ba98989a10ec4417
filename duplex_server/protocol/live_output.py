"""GPT-Live output (pure): reply audio paced at real time, and the output transcript cut to
the audio that left.

A Live client cannot cancel or truncate: what the server has sent is what the user hears,
so the server is the player. :class:`OutputPacer` holds the reply audio and hands out
slices at real time with at most ``lead_ms`` sent ahead of the wall clock; what it still
holds when a barge-in comes (``flush``) is what the user never heard, and the session core
cuts the history there (the transport reports ``Played`` / ``Flushed`` to its
:class:`~duplex_server.protocol.playout.Playout`, the far end being the pacer).

:class:`SpokenText` turns the TTS's marks (the text a chunk of audio speaks: a clause or a
sentence, not a word) into ``session.output_transcript.delta`` pieces released with the
audio: a mark's words are spread over its audio by their share of its characters, and a
word goes out once its estimated end has been sent (the last words of a mark once all its
audio has; while a mark's audio is still coming, its length is estimated at the pace of
the marks already spoken whole, or :data:`OPEN_MS_PER_CHAR` a character before one is).
So a clause cut by a barge-in is reported up to the last whole word whose share of the
clause's audio left: the same proportional cut, to whole words, that the engine's history
makes of the clause (engine/orchestration/history.py).

Positions: the item clock is the reply item's own audio (ms from its start, as the core
numbers its chunks); the session timeline is the session's input audio clock (ms received),
where a burst of output after a silence starts at the input clock's "now" and runs on by
the audio sent. Times given to these classes are the caller's monotonic clock in ms.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

_EPS_MS = 1e-6
#: while a mark's audio is still coming, its length is taken as at least this per character
#: until a whole mark has shown the voice's own pace (slower than speech: its words may
#: come late, not ahead of their audio)
OPEN_MS_PER_CHAR = 90.0


# ---------------------------------------------------------------------------- the pacer
@dataclass(slots=True)
class _Chunk:
    epoch: int
    response_id: str
    item_id: str
    start_ms: float  # on the item's clock
    pcm: bytes  # PCM16 mono at the pacer's rate
    offset: int = 0


@dataclass(frozen=True, slots=True)
class Slice:
    """A piece of reply audio to send now."""

    response_id: str
    item_id: str
    pcm: bytes  # PCM16 mono at the pacer's rate
    item_end_ms: float  # the item's audio sent through this, on its clock
    start_pos_ms: float  # where it plays on the session timeline
    end_pos_ms: float
    queued_ms: float  # what the pacer still holds after it


class OutputPacer:
    """The reply audio not yet sent, released at real time (``lead_ms`` ahead at most)."""

    def __init__(self, rate: int, *, lead_ms: float = 200.0, slice_ms: float = 40.0) -> None:
        self.rate = rate
        self.lead_ms = lead_ms
        self.slice_bytes = max(2, 2 * round(rate * min(slice_ms, lead_ms) / 1000))
        self._queue: deque[_Chunk] = deque()
        self.held_bytes = 0
        self._play_end = 0.0  # monotonic ms at which the far end has played what was sent
        self._pos = 0.0  # session timeline at _play_end

    @property
    def held_ms(self) -> float:
        return self.held_bytes * 500.0 / self.rate

    @property
    def busy(self) -> bool:
        """Audio is held, or some that was sent is still playing at the far end."""
        return bool(self._queue)

    def push(self, epoch: int, response_id: str, item_id: str, start_ms: float, pcm: bytes) -> None:
        """Reply audio of ``item_id`` from ``start_ms`` on its clock (PCM16 at the rate)."""
        if pcm:
            self._queue.append(_Chunk(epoch, response_id, item_id, start_ms, pcm))
            self.held_bytes += len(pcm)

    def purge(self, below_epoch: int) -> bool:
        """Drop audio of cancelled epochs (a barge-in advanced the epoch); True if any."""
        keep = deque(c for c in self._queue if c.epoch >= below_epoch)
        dropped = len(keep) != len(self._queue)
        if dropped:
            self._queue = keep
            self.held_bytes = sum(len(c.pcm) - c.offset for c in keep)
        return dropped

    def flush(self) -> bool:
        """Drop everything not sent (a barge-in); True if audio was dropped."""
        had = bool(self._queue)
        self._queue.clear()
        self.held_bytes = 0
        return had

    def playing_until(self) -> float:
        """When (monotonic ms) what was sent has played out at the far end."""
        return self._play_end

    def take(self, now_ms: float, session_ms: float) -> list[Slice]:
        """The slices to send at ``now_ms``; ``session_ms``: the session timeline now (where
        a burst after a silence starts)."""
        out: list[Slice] = []
        if self._play_end <= now_ms:  # nothing plays: a burst starts now
            self._pos = max(self._pos, session_ms)
            self._play_end = now_ms
        while self._queue:
            chunk = self._queue[0]
            n = min(self.slice_bytes, len(chunk.pcm) - chunk.offset)
            dur = n * 500.0 / self.rate
            if self._play_end + dur - now_ms > self.lead_ms + _EPS_MS:
                break
            pcm = chunk.pcm[chunk.offset : chunk.offset + n]
            chunk.offset += n
            self.held_bytes -= n
            start = self._pos
            self._pos += dur
            self._play_end += dur
            end_ms = chunk.start_ms + chunk.offset * 500.0 / self.rate
            if chunk.offset >= len(chunk.pcm):
                self._queue.popleft()
            out.append(
                Slice(chunk.response_id, chunk.item_id, pcm, end_ms, start, self._pos, self.held_ms)
            )
        return out

    def next_due(self, now_ms: float) -> float | None:
        """When the next slice may go (None: nothing held)."""
        if not self._queue:
            return None
        chunk = self._queue[0]
        n = min(self.slice_bytes, len(chunk.pcm) - chunk.offset)
        due = self._play_end + n * 500.0 / self.rate - self.lead_ms
        return max(now_ms, due)


# ---------------------------------------------------------------------------- spoken text
@dataclass(slots=True)
class _Segment:
    start_ms: float  # item clock: where its audio begins
    text: str
    end_ms: float  # item clock: the end of its audio known so far
    closed: bool = False  # all its audio is known
    sent: int = 0  # characters released


@dataclass(frozen=True, slots=True)
class TextPiece:
    """Words whose audio left, placed on the session timeline."""

    text: str
    start_ms: int
    end_ms: int


@dataclass(slots=True)
class _ItemText:
    segments: list[_Segment] = field(default_factory=list)
    audio_end: float = 0.0  # item clock: the end of its audio known so far
    left: tuple[float, float] | None = None  # (item clock, timeline): its audio left so far


def _word_cut(text: str, n: int) -> int:
    """The largest cut <= ``n`` that ends a word (the text's end counts)."""
    if n >= len(text):
        return len(text)
    while n > 0 and not (text[n].isspace() and not text[n - 1].isspace()):
        n -= 1
    return n


class SpokenText:
    """The reply items' marks and how much of each has been released."""

    def __init__(self) -> None:
        self._items: dict[str, _ItemText] = {}
        self._paced_ms = 0.0  # audio of the marks spoken whole so far ...
        self._paced_chars = 0  # ... and their characters: the voice's pace

    def pace(self) -> float:
        """Milliseconds of audio a character, as spoken so far."""
        if self._paced_chars < 20:
            return OPEN_MS_PER_CHAR
        return self._paced_ms / self._paced_chars

    def _spoken_whole(self, seg: _Segment) -> None:
        if seg.end_ms > seg.start_ms and seg.text.strip():
            self._paced_ms += seg.end_ms - seg.start_ms
            self._paced_chars += len(seg.text)

    def mark(self, item_id: str, start_ms: float, text: str) -> None:
        """The audio of ``item_id`` from ``start_ms`` (its clock) speaks ``text``."""
        item = self._items.setdefault(item_id, _ItemText())
        for seg in item.segments:
            if not seg.closed:  # it ends where this mark's audio begins
                seg.end_ms = max(seg.start_ms, min(seg.end_ms, start_ms))
            seg.closed = True
        if text:  # its audio may have come first (the core sends a chunk, then its mark)
            item.segments.append(_Segment(start_ms, text, max(start_ms, item.audio_end)))

    def audio(self, item_id: str, start_ms: float, duration_ms: float) -> None:
        """Audio of ``item_id`` from ``start_ms`` for ``duration_ms`` is known."""
        item = self._items.setdefault(item_id, _ItemText())
        item.audio_end = max(item.audio_end, start_ms + duration_ms)
        if item.segments and not item.segments[-1].closed:
            seg = item.segments[-1]
            seg.end_ms = max(seg.end_ms, start_ms + duration_ms)

    def ended(self, item_id: str) -> list[TextPiece]:
        """All of ``item_id``'s audio is known: the words this releases. The end may come
        after the item's last audio left (the pacer sent it at once); the words that waited
        for it go now, else no slice would ever release them."""
        item = self._items.get(item_id)
        if item is None:
            return []
        for seg in item.segments:
            seg.closed = True
        if item.left is None:
            return []
        return self.through(item_id, *item.left)

    def flush(self) -> None:
        """A barge-in: what was not released never will be."""
        self._items.clear()

    def forget(self, item_id: str) -> None:
        self._items.pop(item_id, None)

    def through(self, item_id: str, item_ms: float, pos_ms: float) -> list[TextPiece]:
        """``item_id``'s audio has left through ``item_ms`` (its clock), which is ``pos_ms``
        on the session timeline: the words released by it."""
        item = self._items.get(item_id)
        if item is None:
            return []
        if item.left is None or item_ms >= item.left[0]:
            item.left = (item_ms, pos_ms)
        out: list[TextPiece] = []
        for seg in item.segments:
            if seg.sent >= len(seg.text) or seg.start_ms > item_ms + _EPS_MS:
                continue
            span = seg.end_ms - seg.start_ms
            if not seg.closed:
                span = max(span, len(seg.text) * self.pace())
            if seg.closed and item_ms + _EPS_MS >= seg.end_ms:
                cut = len(seg.text)
            elif span <= 0:
                continue
            else:
                share = min(1.0, (item_ms - seg.start_ms) / span)
                cut = _word_cut(seg.text, int(len(seg.text) * share))
                if not seg.closed and cut >= len(seg.text):
                    cut = _word_cut(seg.text, len(seg.text) - 1)  # the last word waits
            if cut <= seg.sent:
                continue
            a = seg.start_ms + span * seg.sent / len(seg.text)
            b = seg.start_ms + span * cut / len(seg.text)
            start = round(pos_ms - (item_ms - a))
            end = max(start, round(pos_ms - (item_ms - b)))
            out.append(TextPiece(seg.text[seg.sent : cut], start, end))
            seg.sent = cut
            if seg.closed and cut >= len(seg.text):
                self._spoken_whole(seg)
        if item.segments and all(s.closed and s.sent >= len(s.text) for s in item.segments):
            del self._items[item_id]
        return out
