"""A Twilio call's marks: what each reply chunk's mark names and what its echo means (pure).

After each chunk of reply audio the server sends a ``mark`` named ``<item_id>:<end_ms>``:
where the chunk ends in the item's audio as sent, counted in samples (not the engine's ms:
the resampler to 8 kHz holds some back, unevenly), so that its echo never claims more than
the caller heard. Twilio echoes a mark once the audio before it has played. A ``clear``
(barge-in) drops what Twilio buffered, but Twilio still echoes the marks of the cleared
audio: those were never heard and are ignored. A mark may also carry the echo canceller's
playout position of its chunk, handed back when it echoes.
"""

from __future__ import annotations


class TwilioMarks:
    """The marks of one Twilio call: names sent, echoes heard, clears; and counts of each."""

    def __init__(self) -> None:
        self.sent = 0
        self.echoed = 0
        self.clears = 0
        self._cleared: set[str] = set()  # items cleared: their late marks are ignored
        self._position: dict[str, int] = {}  # mark name -> playout position (echo control)
        self._sent_end: dict[str, float] = {}  # item -> ms of its audio sent (samples)

    def next(self, item_id: str, nbytes: int, rate: int) -> tuple[str, int]:
        """A chunk of ``nbytes`` of PCM16 at ``rate`` of ``item_id`` is sent: the name of its
        mark and the ms of the item's audio sent through it."""
        end = self._sent_end.get(item_id, 0.0) + nbytes / (2 * rate) * 1000
        self._sent_end[item_id] = end
        end_ms = round(end)
        self.sent += 1
        return f"{item_id}:{end_ms}", end_ms

    def hold_position(self, name: str, position: int) -> None:
        """The echo canceller's playout position at the end of mark ``name``'s chunk."""
        if position:
            self._position[name] = position

    def clear(self, item_id: str | None) -> None:
        """A ``clear`` is sent: ``item_id``'s later marks were never heard."""
        if item_id is not None:
            self._cleared.add(item_id)
        self._position.clear()
        self.clears += 1

    def echo(self, name: str, item_id: str) -> tuple[bool, int | None]:
        """Twilio echoed mark ``name`` (of ``item_id``): whether it was heard (not cleared)
        and the echo canceller's playout position it holds, if any."""
        self.echoed += 1
        if item_id in self._cleared:
            return False, None
        return True, self._position.pop(name, None)
