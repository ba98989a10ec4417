"""Playout state (pure): the reply audio the core emitted and what the far end reported of
it, and the barge-in rule for audio the far end still plays after its response ended.

The seam. The core builds every audio delta, so it knows what it emitted: per item (and its
response), the end of the latest chunk on the item's audio clock (ms) and the PCM rate.
A transport whose far end plays the audio at real time (Twilio Media Streams, WebRTC) is
told nothing by its far end unless it reports, so it reports, through one core method
(``SessionMachine.on_playout``), typed :data:`PlayoutReport` inputs:

- :class:`Queued`: the far end was handed audio of an item (the transport wrote it);
- :class:`Played`: the far end played an item through ``played_ms`` (as heard: the
  transport counts what its far end rendered) and still holds ``queued_ms`` of audio;
- :class:`Flushed`: the transport dropped what its far end had not played (it carried out
  ``output_audio_buffer.cleared``).

The WebSocket never reports (the client plays its audio, and truncates and clears it
itself), so for it nothing here ever fires. No transport is held or asked.

Decisions taken here, from that state:

- :meth:`Playout.talk_over`: the user talking over audio the far end still plays after its
  response ended (``response.done`` long before the caller has heard it) clears it, by the
  same guards as a barge-in on a response in progress
  (:func:`~duplex_server.protocol.input.should_interrupt`: ``interrupt_response``,
  ``min_interrupt_speech_ms`` of speech, and ``uninterruptible_ms`` from the start of the
  response whose audio plays), at most once per response: ``output_audio_buffer.cleared``.
- :meth:`Playout.flushed`: once the far end's playout is dropped, the item it played is
  truncated to what was heard if the far end held audio it never played (the session
  machine does it as a ``conversation.item.truncate`` of its own: no client JSON is forged).

Units. ``played_ms`` is on the item's audio clock but counts what the far end rendered: a
transport that resamples the reply (Twilio's 8 kHz, WebRTC's 48 kHz) renders a little less
of an item than the core emitted (the resampler holds its tail back, unevenly), so played
and emitted ms are never compared to say whether the far end is done; the far end says so
(``queued_ms``).

Designed for what comes next (the seam and its state only, not these features):

- A server that paces its output at real time itself (OpenAI's GPT-Live wire has no client
  cancel or truncate: what is not yet sent is what the user did not hear). The pacer is the
  far end: it reports :class:`Queued` as audio enters its buffer, :class:`Played` with the
  ms it has *sent* (sent is heard) and what it still holds, and :class:`Flushed` when a
  barge-in drops the rest; the truncation to what was sent follows from the same state.
- An answer paused and resumed without losing or repeating a byte (a barge-in that turns
  out to be "mm-hm" is taken back): :meth:`Playout.position` says where the far end's
  playout of an item stands, "at ms X (byte :attr:`PlayoutPosition.played_bytes` of its
  PCM16 at :attr:`PlayoutPosition.sample_rate`) of item Y of response R, of E ms
  emitted"; a resume re-emits the item from there.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from duplex_server.protocol import events as ev
from duplex_server.protocol.commands import Action, Send
from duplex_server.protocol.input import should_interrupt

#: items whose playout state is kept (the far end holds one or two at a time; a WebSocket
#: session, which never reports, would otherwise keep one per response)
_KEEP = 4


# ---------------------------------------------------------------------------- reports
@dataclass(frozen=True, slots=True)
class Queued:
    """The far end was handed audio of ``item_id`` to play."""

    item_id: str


@dataclass(frozen=True, slots=True)
class Played:
    """The far end played ``item_id`` through ``played_ms`` of its audio (as heard) and
    holds ``queued_ms`` more it has not played (0: it has played all it was handed)."""

    item_id: str
    played_ms: float
    queued_ms: float


@dataclass(frozen=True, slots=True)
class Flushed:
    """The far end dropped the audio it had not played (``output_audio_buffer.cleared``)."""


PlayoutReport = Queued | Played | Flushed


@dataclass(frozen=True, slots=True)
class PlayoutPosition:
    """Where the far end's playout of one item stands."""

    item_id: str
    response_id: str
    played_ms: float  # heard, on the item's audio clock
    emitted_ms: float  # what the core emitted of the item
    sample_rate: int  # of the PCM16 the core emitted

    @property
    def played_bytes(self) -> int:
        """``played_ms`` as an offset into the item's PCM16 (whole samples)."""
        return 2 * round(self.played_ms * self.sample_rate / 1000)


@dataclass(slots=True)
class _Item:
    response_id: str
    sample_rate: int
    emitted_ms: float = 0.0
    played_ms: float = 0.0
    held: bool = False  # the far end holds audio of it that it has not played


class Playout:
    """One session's reply audio: what the core emitted and what the far end reported."""

    def __init__(self) -> None:
        self._items: OrderedDict[str, _Item] = OrderedDict()
        self._far: str | None = None  # the item the far end was handed last
        self._cleared: str | None = None  # the response whose playout was cleared last

    # ------------------------------------------------------------------ the core's side
    def emitted(self, response_id: str, item_id: str, end_ms: float, sample_rate: int) -> None:
        """The core emitted audio of ``item_id`` through ``end_ms`` of its audio clock."""
        item = self._items.get(item_id)
        if item is None:
            item = self._items[item_id] = _Item(response_id, sample_rate)
            self._trim()
        item.emitted_ms = max(item.emitted_ms, end_ms)

    # ------------------------------------------------------------------ the far end's side
    def report(self, report: Queued | Played) -> None:
        """A progress report from the transport (reports of items it no longer holds,
        after a flush, are ignored)."""
        item = self._items.get(report.item_id)
        if item is None:
            return
        if isinstance(report, Queued):
            item.held = True
            self._far = report.item_id
            return
        item.played_ms = max(item.played_ms, report.played_ms)
        item.held = report.queued_ms > 0

    def flushed(self) -> PlayoutPosition | None:
        """The far end dropped what it had not played: the item it was playing and what was
        heard of it if some of it was dropped unheard (it is to be truncated), else None.
        The far end holds nothing now; what it played is forgotten."""
        far = self._far
        self._far = None
        if far is None:
            return None
        item = self._items.get(far)
        cut = self._position(far) if item is not None and item.held else None
        while self._items:  # that item and every one before it
            if self._items.popitem(last=False)[0] == far:
                break
        return cut

    # ------------------------------------------------------------------ decisions
    def playing(self) -> str | None:
        """The response whose audio the far end holds and has not played yet."""
        item = None if self._far is None else self._items.get(self._far)
        return item.response_id if item is not None and item.held else None

    def position(self, item_id: str | None = None) -> PlayoutPosition | None:
        """Where the playout of ``item_id`` (default: the item the far end was handed
        last) stands; None if unknown."""
        item_id = self._far if item_id is None else item_id
        return None if item_id is None else self._position(item_id)

    def talk_over(
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
        playing = self.playing()
        if playing is None or playing == self._cleared:
            return []
        started = last_started[1] if last_started and last_started[0] == playing else None
        if not should_interrupt(
            td, speech_ms, response_active=True, response_started_ms=started, now_ms=now_ms
        ):
            return []
        self._cleared = playing
        return [Send(ev.OutputAudioCleared(response_id=playing))]

    # ------------------------------------------------------------------ internals
    def _position(self, item_id: str) -> PlayoutPosition | None:
        item = self._items.get(item_id)
        if item is None:
            return None
        return PlayoutPosition(
            item_id, item.response_id, item.played_ms, item.emitted_ms, item.sample_rate
        )

    def _trim(self) -> None:
        for item_id in list(self._items):
            if len(self._items) <= _KEEP:
                return
            if item_id != self._far:  # (the far end may still play it)
                del self._items[item_id]
