"""A paused Live answer's end waits for its audio (pure; ``interruption: confirm``).

While an item is paused (``output_audio_buffer.paused``) the core holds the audio the
engine goes on making, but not the item's ``response.output_audio.done``. A Live transport
reads that end as "all the item's audio is known" and releases the item's last words by it
(:class:`~duplex_server.protocol.live_output.SpokenText`), so words whose audio was never
sent would go out. :class:`PausedEnds` holds the end of a paused item until the resume has
sent its audio again (the batch whose first chunk is marked ``restart``, or the resume
itself when there is nothing to send again), or puts it after the clear when the pause
ended in a stop (the clear drops the words). The adapter runs every core action through it.
"""

from __future__ import annotations

from duplex_server.protocol import events as ev
from duplex_server.protocol.commands import Action, Send, SendAudio
from duplex_server.protocol.playout import Playout

#: core events a Live transport gets as they are (it acts on them; beside its Live events)
TRANSPORT_EVENTS = ev.AudioDone | ev.OutputAudioCleared | ev.OutputAudioPaused


class PausedEnds:
    """The items paused now, and the ends held for them."""

    def __init__(self, playout: Playout) -> None:
        self.playout = playout
        self._paused: set[str] = set()
        self._held: dict[str, Send] = {}
        self._resumed: list[str] = []  # resumed in the batch in progress

    def hold(self, action: Send) -> bool:
        """Note a core event; True if it is an end to hold (not sent now)."""
        event = action.event
        if isinstance(event, ev.OutputAudioPaused):
            self._paused.add(event.item_id)
        elif isinstance(event, ev.AudioDone) and event.item_id in self._paused:
            self._held[event.item_id] = action
            return True
        elif isinstance(event, ev.OutputAudioResumed) and event.item_id in self._paused:
            if not self.playout.resume_pending(event.item_id):  # its audio follows, if any
                self._paused.discard(event.item_id)
                self._resumed.append(event.item_id)
        elif isinstance(event, ev.OutputAudioCleared):
            self._paused.clear()
        return False

    def sent(self, action: Send, out: list[Action]) -> None:
        """``action`` went out: after a clear (a stop) the ends held go too."""
        if isinstance(action.event, ev.OutputAudioCleared):
            out.extend(self._held.values())
            self._held.clear()

    def audio(self, audio: SendAudio) -> None:
        """Audio went out: a resume's first chunk ends the item's pause."""
        if audio.restart and audio.item_id in self._paused:
            self._paused.discard(audio.item_id)
            self._resumed.append(audio.item_id)

    def batch_done(self, out: list[Action]) -> None:
        """The end of a batch: the ends of the items resumed in it, after their audio."""
        for item_id in self._resumed:
            done = self._held.pop(item_id, None)
            if done is not None:
                out.append(done)
        self._resumed.clear()
