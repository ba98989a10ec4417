"""What the server sends on a Twilio call, and what the echoes of its marks say.

:class:`TwilioOut` is a Twilio call's :class:`~duplex_server.transports.media.MediaOut`: reply
audio goes out as ``media`` (the delta's own base64 mu-law), each chunk followed by a
``mark`` named where it ends in the item's audio as sent
(:class:`~duplex_server.transports.twilio_marks.TwilioMarks`); a barge-in sends ``clear``;
other server events are only logged when they are errors (Twilio has no channel for them).
It reports playout to the session core through its link: each chunk sent is ``Queued``;
when Twilio echoes a mark, the caller has heard the audio before it: ``Played`` (how far the
item played and how much of it Twilio still holds), and the echo canceller learns how far
its reference played.
"""

from __future__ import annotations

import logging

from starlette.websockets import WebSocket

from duplex_server.protocol import events as ev
from duplex_server.transports import twilio_wire as wire
from duplex_server.transports.media import MediaLink
from duplex_server.transports.twilio_marks import TwilioMarks

log = logging.getLogger(__name__)


class TwilioOut:
    """The sending side of one Twilio Media Stream; ``stream_sid``: set by its ``start``."""

    def __init__(self, ws: WebSocket, link: MediaLink) -> None:
        self.ws = ws
        self.link = link
        self.marks = TwilioMarks()
        self.stream_sid = ""

    async def send(self, msg: wire.Outbound) -> None:
        await self.ws.send_text(wire.encode(msg))

    async def write_audio(self, event: ev.AudioDelta, pcm: bytes, rate: int) -> None:
        sid = self.stream_sid
        await self.send(wire.SendMedia(streamSid=sid, media=wire.OutMedia(event.delta)))
        self.link.audio_queued(event.item_id)  # its mark's echo reports it played
        # the mark names where this chunk ends in the item's audio as sent, so that its
        # echo never claims more than the caller heard
        name = self.marks.next(event.item_id, len(pcm), rate, event.audio_start_ms)
        feed = self.link.feed
        if feed is not None:
            self.marks.hold_position(name, feed.reference(pcm, rate))
        await self.send(wire.SendMark(streamSid=sid, mark=wire.OutMark(name)))

    async def write_event(self, event: ev.ServerEvent, data: bytes) -> None:
        if isinstance(event, ev.Error):
            log.warning("twilio %s: %s", self.stream_sid, event.error.message)

    async def write_raw(self, data: bytes) -> None:
        log.warning("twilio %s: %s", self.stream_sid, data.decode(errors="replace"))

    async def flush_playout(self) -> None:
        if self.marks.item is None:
            return  # nothing sent since the last clear (a stop after a pause): none needed
        self.marks.clear()
        await self.send(wire.Clear(streamSid=self.stream_sid))

    def audio_done(self, response_id: str) -> None:
        """Nothing to do: each chunk's mark already says where it ends."""

    async def hang_up(self, code: int, reason: str) -> None:
        try:
            await self.ws.close(code, reason)
        except Exception:  # already closed by Twilio
            log.debug("twilio socket already closed", exc_info=True)

    def mark_echoed(self, msg: wire.Mark) -> None:
        """Twilio played the audio before a mark we sent (raises ``Malformed`` if the mark
        is not one of ours)."""
        item, end_ms = msg.position()
        echo = self.marks.echo(msg.mark.name, item, end_ms)
        if echo is None:
            return  # Twilio echoes the marks of cleared audio: it was never heard
        self.link.audio_played(echo.item_id, echo.played_ms, echo.queued_ms)
        feed = self.link.feed
        if echo.position is not None and feed is not None:
            feed.played_through(echo.position)
