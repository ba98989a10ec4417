"""Talking over audio the far end still plays (pure): the core's barge-in rule for it.

A media transport (Twilio Media Streams, WebRTC) hands reply audio to a far end that plays
it at real time, so a response can be over (``response.done``) while the caller still
hears it. The caller talking over that audio clears it: the core sends
``output_audio_buffer.cleared`` (the transport flushes its playout and truncates the item
to what was heard). It is decided here, by the same guards as a barge-in on a response in
progress (:func:`~duplex_server.protocol.input.should_interrupt`: ``interrupt_response``,
``min_interrupt_speech_ms`` of speech, and ``uninterruptible_ms`` from the start of the
response whose audio plays), at most once per response.

The transport tells the core what plays through :class:`FarEnd` (held weakly: the core
keeps no transport alive). A transport without a far-end playout (the WebSocket: the
client plays and clears its own audio) attaches none, and nothing here ever fires.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

from duplex_server.protocol import events as ev
from duplex_server.protocol.commands import Action, Send
from duplex_server.protocol.input import should_interrupt


class FarEnd(Protocol):
    """A transport whose far end plays the audio it was sent."""

    def playing(self) -> str | None:
        """The response whose audio the far end has been sent and not played yet."""
        ...


class TalkOver:
    """One session's rule for far-end audio that outlives its response."""

    def __init__(self) -> None:
        self._far_end: weakref.ref[Any] | None = None
        self._cleared: str | None = None  # the response whose playout was cleared last

    def attach(self, far_end: FarEnd | None) -> None:
        """The transport now attached (None: one without far-end playout)."""
        self._far_end = None if far_end is None else weakref.ref(far_end)

    def check(
        self,
        td: ev.TurnDetection | None,
        speech_ms: float,
        *,
        last_started: tuple[str, float] | None,
        now_ms: float,
    ) -> list[Action]:
        """``speech_ms`` of user speech while no response is in progress: clear the audio
        the far end still plays if the barge-in guards let it. ``last_started``: the id
        and start (ms) of the latest response (its uninterruptible window)."""
        far_end: FarEnd | None = None if self._far_end is None else self._far_end()
        playing = None if far_end is None else far_end.playing()
        if playing is None or playing == self._cleared:
            return []
        started = last_started[1] if last_started and last_started[0] == playing else None
        if not should_interrupt(
            td, speech_ms, response_active=True, response_started_ms=started, now_ms=now_ms
        ):
            return []
        self._cleared = playing
        return [Send(ev.OutputAudioCleared(response_id=playing))]
