"""A Twilio call's marks: what each reply chunk's mark names and what its echo means (pure).

After each chunk of reply audio the server sends a ``mark`` named ``<item_id>:<end_ms>``:
where the chunk ends in the item's audio as sent, counted in samples (not the engine's ms:
the resampler to 8 kHz holds some back, unevenly), so that its echo never claims more than
the caller heard. Twilio echoes a mark once the audio before it has played: the echo says
how far the item played and how much of it was sent after (what Twilio still holds of it),
the transport's ``Played`` report to the session core
(:mod:`duplex_server.protocol.playout`). A ``clear`` (barge-in) drops what Twilio buffered,
but Twilio still echoes the marks of the cleared audio: those were never heard and are
ignored. An item cleared by a pause and sent again from where it paused (a pause taken back)
is counted from there, and only the marks sent after the clear are heard. A mark may also
carry the echo canceller's playout position of its chunk, handed back when it echoes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class MarkEcho:
    """A heard mark: ``item_id`` played through ``played_ms`` (as sent, in samples) and
    ``queued_ms`` more of it was sent after; ``position``: the echo canceller's playout
    position the mark carried, if any."""

    item_id: str
    played_ms: float
    queued_ms: float
    position: int | None


class TwilioMarks:
    """The marks of one Twilio call: names sent, echoes heard, clears; and counts of each."""

    def __init__(self) -> None:
        self.sent = 0
        self.echoed = 0
        self.clears = 0
        self.item: str | None = None  # the item whose audio was sent last (a clear drops it)
        self._cleared: set[str] = set()  # items cleared: their late marks are ignored
        self._position: dict[str, int] = {}  # mark name -> playout position (echo control)
        self._sent_end: dict[str, float] = {}  # item -> ms of its audio sent (samples)
        self._pending: dict[str, int] = {}  # mark name -> sent and not yet echoed
        self._resent: set[str] = set()  # items sent again after a clear

    def next(self, item_id: str, nbytes: int, rate: int, start_ms: float | None = None) -> str:
        """A chunk of ``nbytes`` of PCM16 at ``rate`` of ``item_id`` is sent: the name of its
        mark (where the item's audio sent ends with it, in whole ms). ``start_ms``: where
        the chunk starts on the item's clock, used when a cleared item is sent again from
        there (a pause taken back)."""
        if item_id in self._cleared and start_ms is not None:
            self._cleared.discard(item_id)  # its audio again: counted from where it resumes
            self._sent_end[item_id] = start_ms
            self._resent.add(item_id)
        end = self._sent_end.get(item_id, 0.0) + nbytes / (2 * rate) * 1000
        self._sent_end[item_id] = end
        self.item = item_id
        self.sent += 1
        name = f"{item_id}:{round(end)}"
        self._pending[name] = self._pending.get(name, 0) + 1
        return name

    def hold_position(self, name: str, position: int) -> None:
        """The echo canceller's playout position at the end of mark ``name``'s chunk."""
        if position:
            self._position[name] = position

    def clear(self) -> None:
        """A ``clear`` is sent: the later marks of the item sent last were never heard."""
        if self.item is not None:
            self._cleared.add(self.item)
            self.item = None
        self._position.clear()
        self._pending.clear()  # what Twilio echoes of them now was never heard
        self.clears += 1

    def echo(self, name: str, item_id: str, end_ms: float) -> MarkEcho | None:
        """Twilio echoed mark ``name`` (of ``item_id``, ending at ``end_ms``): what it says,
        or None if its audio was cleared (never heard)."""
        self.echoed += 1
        if item_id in self._cleared:
            return None
        count = self._pending.get(name, 0)
        if item_id in self._resent and not count:
            return None  # a mark of the audio cleared before the item was sent again
        if count > 1:
            self._pending[name] = count - 1
        else:
            self._pending.pop(name, None)
        queued_ms = round(self._sent_end.get(item_id, end_ms)) - end_ms
        return MarkEcho(item_id, end_ms, queued_ms, self._position.pop(name, None))
