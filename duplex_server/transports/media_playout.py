"""What a media transport's far end has been sent and has played, per item (pure).

A media transport (Twilio Media Streams, WebRTC) hands reply audio to a far end that plays
it at real time. :class:`MediaPlayout` keeps, per assistant item, how much of its audio was
sent (ms, the end of the last chunk) and how much the far end reports played, and which item
and response were sent last. It is the session core's
:class:`~duplex_server.protocol.playout.FarEnd` (:meth:`MediaPlayout.playing`: the response
whose audio still plays, which talking over clears) and, on a barge-in, says how far the
item was heard (:meth:`MediaPlayout.cut`) so that the transport truncates the item to it.

This is the transports' side of the playout seam as it stands (issue 37, item 4): the session
core is to learn playout as input events instead, and this bookkeeping then moves there.
"""

from __future__ import annotations

from collections.abc import Callable

from duplex_server.protocol import events as ev


class MediaPlayout:
    """One media transport's playout per item. ``still_queued``: the transport's own word on
    whether audio waits to be played (WebRTC: its track's queue); without it, audio is
    pending while less of the last item was played than was sent."""

    def __init__(self, still_queued: Callable[[], bool] | None = None) -> None:
        #: audio sent per item (ms, end of the last chunk) and what the far end played
        self.sent_ms: dict[str, float] = {}
        self.played_ms: dict[str, float] = {}
        self.item: str | None = None  # the item whose audio is playing or queued
        self.response: str | None = None  # ... and its response
        self._still_queued = still_queued

    def sent(self, event: ev.AudioDelta) -> None:
        """``event``'s audio went to the far end (as the engine timed it)."""
        self.item, self.response = event.item_id, event.response_id
        self.sent_ms[event.item_id] = event.audio_start_ms + event.duration_ms
        self.played_ms.setdefault(event.item_id, 0.0)

    def sent_through(self, item_id: str, ms: float) -> None:
        """The transport's own count of ``item_id``'s audio sent (ms), e.g. in samples."""
        self.sent_ms[item_id] = ms

    def played(self, item_id: str, ms: float) -> None:
        """The far end reports that ``item_id`` played through ``ms`` (never backwards)."""
        if item_id in self.played_ms:
            self.played_ms[item_id] = max(self.played_ms[item_id], ms)

    @property
    def pending(self) -> bool:
        """Audio sent to the far end and not played yet."""
        if self._still_queued is not None:
            return self._still_queued()
        item = self.item
        return item is not None and self.played_ms.get(item, 0.0) < self.sent_ms.get(item, 0.0)

    def playing(self) -> str | None:
        """The response whose audio the far end still plays (talking over it clears it)."""
        return self.response if self.pending else None

    def cut(self) -> tuple[str, int] | None:
        """A barge-in: forget the item last sent; ``(item, ms heard)`` when the far end
        heard less of it than it was sent (the item is to be truncated there)."""
        item = self.item
        if item is None:
            return None
        self.item = None
        played = int(self.played_ms.pop(item, 0.0))
        if self.sent_ms.pop(item, 0.0) > played:
            return item, played
        return None
