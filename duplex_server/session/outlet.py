"""Where a live session's events go: the attached transport, or the journal alone.

:class:`Outlet` holds the session's attachment (the transport attached now, seen only as an
:class:`~duplex_server.session.attach.Attachment`) and its stamper
(:class:`~duplex_server.session.attach.Stamper`, which writes the session's
:class:`~duplex_server.session.attach.Journal`). An event sent while a
transport is attached is queued there and stamped when written (:meth:`Outlet.next_frame`);
while none is (or after the session's last words: what follows a dropped queue is never
refused) it is stamped and journaled at once, for a resume to replay. On a takeover or a
detach, what the old transport never wrote is journaled in order. It carries out the
session core's actions on the transport: purge stale audio, send pre-stamped frames, drop the
queue, close, release.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from duplex_server.protocol import events as ev
from duplex_server.protocol.codec import encode_server_event
from duplex_server.session.attach import Attachment, Journal, Outgoing, Stamper


class Outlet:
    """One session's output side: attachment, stamping and journal."""

    def __init__(self, stamper: Stamper) -> None:
        self.stamper = stamper
        self.attachment: Attachment | None = None
        self._last_words = False  # the queue was dropped: stamp now, never refuse

    @property
    def journal(self) -> Journal:
        return self.stamper.journal

    def attach(self, attachment: Attachment) -> None:
        self.attachment = attachment

    # ------------------------------------------------------------------ events out
    def send(
        self, event: ev.ServerEvent, *, beta: bool, t_in: float = 0.0, pcm: bytes = b""
    ) -> bool:
        """Queue ``event`` on the transport (or stamp and journal it now); False if the
        transport's queue is over its budget (a slow client). ``pcm``: an audio delta's
        audio as PCM16 at the output rate (what a media transport plays)."""
        self.stamper.beta = beta
        att = self.attachment
        if att is None or self._last_words:
            data = self.stamper.stamp(event, time.monotonic())  # journaled for a resume
            if att is not None:
                att.send_stamped(data)
            return True
        epoch = event.epoch if isinstance(event, ev.AudioDelta) else None
        size = len(event.delta) + 256 if isinstance(event, ev.AudioDelta) else 512
        return att.send_event(Outgoing(event, None, size, epoch, t_in, pcm))

    def next_frame(self, item: Outgoing) -> bytes:
        """A transport writes ``item`` (not stale): its bytes, stamped and journaled now."""
        if item.raw is not None:
            return item.raw
        assert item.event is not None
        return self.stamper.stamp(item.event, time.monotonic())

    def journal_unsent(self, att: Attachment, epoch: int) -> None:
        """Stamp and journal what ``att`` never wrote, but audio of epochs before ``epoch``."""
        now = time.monotonic()
        for item in att.take_unsent():
            if item.event is not None:
                if item.epoch is not None and item.epoch < epoch:
                    continue
                self.stamper.stamp(item.event, now)

    # ------------------------------------------------------------------ transports
    def take_over(self, epoch: int) -> None:
        """Another transport resumes the session: the old one's unsent output is journaled,
        and it is sent ``session.replaced`` (stamped for it alone) and let go."""
        old = self.attachment
        if old is None:
            return
        self.journal_unsent(old, epoch)
        seq = self.stamper.seq
        data, _ = encode_server_event(
            ev.SessionReplaced(), event_id=f"event_replaced_{seq}", seq=seq
        )
        old.replaced(data)
        self.attachment = None

    def detach(self, attachment: Attachment, epoch: int) -> bool:
        """``attachment`` went away (it may resume): journal what it never wrote. False if
        it was not the one attached."""
        if self.attachment is not attachment:
            return False
        self.journal_unsent(attachment, epoch)
        self.attachment = None
        return True

    def let_go(self, attachment: Attachment) -> bool:
        """``attachment`` is done (closed normally): drop what it never wrote. False if it
        was not the one attached."""
        if self.attachment is not attachment:
            return False
        attachment.take_unsent()
        self.attachment = None
        return True

    # ------------------------------------------------------------------ the core's actions
    def purge_audio(self, below_epoch: int) -> int:
        att = self.attachment
        return att.purge_audio(below_epoch) if att is not None else 0

    def send_stamped(self, frames: Sequence[bytes]) -> None:
        if self.attachment is not None:
            for data in frames:
                self.attachment.send_stamped(data)

    def drop_output(self) -> None:
        if self.attachment is not None:
            self.attachment.take_unsent()
            self._last_words = True  # what follows is stamped now, never refused

    def close(self, code: int, reason: str) -> None:
        if self.attachment is not None:
            self.attachment.close(code, reason)

    def release(self) -> None:
        self.attachment = None
        self._last_words = False
