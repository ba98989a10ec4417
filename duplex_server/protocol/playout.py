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

Pause and resume (``interrupt_mode: confirm``, :mod:`~duplex_server.protocol.barge_in`):
where the far end reports playout (:class:`FarEnd`, said once by the transport: WebRTC,
Twilio, a server-paced wire), the core keeps the PCM16 of the latest item it emitted. A
pause (:meth:`Playout.pause`) holds the item's audio in the core from then on (it is not
emitted), and the transport flushes its far end on ``output_audio_buffer.paused`` and says
so (:class:`Flushed`, which then truncates nothing). A resume (:meth:`Playout.resume`)
emits the item again from the far end's last played position, byte for byte (whole samples
of the item's PCM16), in 100 ms chunks, the first marked ``restart``; a stop
(:meth:`Playout.release`) drops what was held, and the flush that follows truncates the
item to what was heard before the pause. A server that paces its output at real time (the
GPT-Live wire) is such a far end: it reports :class:`Queued`, :class:`Played` with the ms
it has *sent* (sent is heard) and :class:`Flushed` when it drops the rest. Over a WebSocket
(no reports) the client pauses and resumes its own player; :meth:`Playout.audible` then
estimates whether it still plays an item from what was emitted and when.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from duplex_server.protocol import events as ev
from duplex_server.protocol.commands import Action, Send, SendAudio
from duplex_server.protocol.input import should_interrupt

#: items whose playout state is kept (the far end holds one or two at a time; a WebSocket
#: session, which never reports, would otherwise keep one per response)
_KEEP = 4
#: a resume emits the held audio again in chunks this long (ms), as the engine's
_RESUME_CHUNK_MS = 100
#: a WebSocket client is believed to play an item until this long after the end of the
#: audio emitted (counted from its first chunk, at real time, pauses added): its jitter
#: buffer and the network
_CLIENT_SLACK_MS = 500.0


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
    """The far end dropped the audio it had not played (``output_audio_buffer.cleared``,
    or ``.paused``)."""


@dataclass(frozen=True, slots=True)
class FarEnd:
    """The transport plays the session's audio at a far end and reports its playout (said
    once, when it opens the session): the server owns playout."""


PlayoutReport = Queued | Played | Flushed | FarEnd


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
    epoch: int = 0  # of its audio
    pcm: bytearray = field(default_factory=bytearray)  # what was emitted (server playout)
    first_ms: float | None = None  # when its first audio was emitted (the session's clock)
    paused: bool = False  # its audio is held in the core (a pause)
    paused_at: float | None = None  # when the pause began (a WebSocket client's estimate)
    paused_ms: float = 0.0  # how long it was paused so far (a WebSocket client's estimate)
    cut: bool = False  # a pause's flush dropped audio of it the far end had not played
    flushing: bool = False  # a pause's flush has not been reported yet
    resuming: bool = False  # resumed before that flush was reported: emit it after
    gone: bool = False  # its response was cancelled: it is heard no more


class Playout:
    """One session's reply audio: what the core emitted and what the far end reported."""

    def __init__(self) -> None:
        self._items: OrderedDict[str, _Item] = OrderedDict()
        self._far: str | None = None  # the item the far end was handed last
        self._cleared: str | None = None  # the response whose playout was cleared last
        self._resumed: list[SendAudio] = []  # a resume's audio, waiting for its flush
        self.far_end = False  # the transport reports playout (:class:`FarEnd`)

    # ------------------------------------------------------------------ the core's side
    def emitted(self, response_id: str, item_id: str, end_ms: float, sample_rate: int) -> None:
        """The core emitted audio of ``item_id`` through ``end_ms`` of its audio clock."""
        item = self._items.get(item_id)
        if item is None:
            item = self._items[item_id] = _Item(response_id, sample_rate)
            self._trim()
        item.emitted_ms = max(item.emitted_ms, end_ms)

    def emit(self, audio: SendAudio, now_ms: float) -> list[Action]:
        """Reply audio the core produced: ``[audio]`` to send, or none while its item is
        paused (the audio is held). With a far end that reports playout, the item's PCM
        is kept so that a pause can be taken back."""
        end = audio.audio_start_ms + audio.duration_ms
        self.emitted(audio.response_id, audio.item_id, end, audio.sample_rate)
        item = self._items[audio.item_id]
        item.epoch = audio.epoch
        if item.first_ms is None:
            item.first_ms = now_ms
        if self.far_end:
            for other_id, other in self._items.items():  # only the latest item's is kept
                if other_id != audio.item_id and not other.paused:
                    other.pcm = bytearray()
            item.pcm += audio.pcm
            if item.paused:
                return []  # held: a resume emits it from where the far end stopped
        return [audio]

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
        The far end holds nothing now; what it played is forgotten. A paused item's flush
        (the pause's own) truncates nothing: the item stays, to resume from what was heard
        (or to be truncated there by the flush of a stop)."""
        far = self._far
        paused = [i for i in self._items.values() if i.paused or i.flushing or i.resuming]
        if paused:  # a pause's own flush
            for item in paused:
                item.cut = item.cut or item.held
                item.held = item.flushing = False
                if item.resuming:  # resumed before this flush was reported: emit it now
                    item.resuming = False
                    self._resumed += self._again(item)
            return None
        self._far = None
        if far is None:
            return None
        last = self._items.get(far)
        cut = self._position(far) if last is not None and (last.held or last.cut) else None
        while self._items:  # that item and every one before it
            if self._items.popitem(last=False)[0] == far:
                break
        return cut

    def take_resumed(self) -> list[SendAudio]:
        """The audio of a resume decided before its pause's flush was reported."""
        out, self._resumed = self._resumed, []
        return out

    # ------------------------------------------------------------------ pause and resume
    def pause(self, item_id: str, now_ms: float) -> None:
        """Hold ``item_id``'s audio in the core from now on; with a far end that reports
        playout, the transport flushes it (``output_audio_buffer.paused``)."""
        item = self._items.get(item_id)
        if item is None or item.paused:
            return
        item.paused = True
        item.paused_at = now_ms
        item.flushing = self.far_end  # the transport flushes on the pause and says so

    def resume(self, item_id: str, now_ms: float) -> list[SendAudio]:
        """Take a pause back: the item's audio from the far end's last played position
        (none over a WebSocket: its client resumes its own player)."""
        item = self._items.get(item_id)
        if item is None or not item.paused:
            return []
        item.paused = False
        if item.paused_at is not None:
            item.paused_ms += now_ms - item.paused_at
            item.paused_at = None
        if not self.far_end:
            return []
        if item.flushing:  # the far end has not flushed yet: emit when it says so
            item.resuming = True
            return []
        return self._again(item)

    def release(self, item_id: str) -> None:
        """A pause ends in a stop: nothing held of ``item_id`` is emitted; the flush that
        follows truncates it to what was heard."""
        item = self._items.get(item_id)
        if item is not None:
            item.paused = item.resuming = False
            item.pcm = bytearray()

    def drop_held(self) -> None:
        """A cancel (a new epoch): no held audio is ever emitted."""
        for item in self._items.values():
            item.paused = item.resuming = False
            item.pcm = bytearray()
            item.gone = True
        self._resumed.clear()

    def resume_position(self, item_id: str) -> float | None:
        """Where a resume of ``item_id`` starts on its audio clock (None: the client's)."""
        item = self._items.get(item_id)
        return item.played_ms if item is not None and self.far_end else None

    def resume_pending(self, item_id: str) -> bool:
        """Was ``item_id`` resumed before its pause's flush was reported (its audio is
        emitted when it is)?"""
        item = self._items.get(item_id)
        return item is not None and item.resuming

    def is_paused(self, item_id: str) -> bool:
        """Is ``item_id``'s audio held by a pause now?"""
        item = self._items.get(item_id)
        return item is not None and item.paused

    def alive(self, item_id: str) -> bool:
        """May ``item_id`` still be heard (not cancelled, flushed or trimmed)?"""
        item = self._items.get(item_id)
        return item is not None and not item.gone

    # ------------------------------------------------------------------ decisions
    def playing(self) -> str | None:
        """The response whose audio the far end holds and has not played yet."""
        item = None if self._far is None else self._items.get(self._far)
        return item.response_id if item is not None and item.held else None

    def audible(self, now_ms: float) -> tuple[str, str] | None:
        """(response id, item id) of the audio the user may be hearing now: the item the
        far end holds or that is paused; over a WebSocket the latest item until its audio
        has had time to play (from its first chunk, at real time, pauses added)."""
        for item_id, item in reversed(self._items.items()):
            if item.paused or item.resuming:
                return item.response_id, item_id
        if self.far_end:
            far = self._far
            held = None if far is None else self._items.get(far)
            if far is not None and held is not None and not held.gone and (held.held or held.cut):
                return held.response_id, far
            return None
        if not self._items:
            return None
        last_id, last = next(reversed(self._items.items()))
        if last.first_ms is None or last.gone:
            return None
        until = last.first_ms + last.emitted_ms + last.paused_ms + _CLIENT_SLACK_MS
        return (last.response_id, last_id) if now_ms < until else None

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
        return self.clear(playing)

    def clear(self, response_id: str) -> list[Action]:
        """Clear ``response_id``'s audio the far end still plays (once per response)."""
        if response_id == self._cleared:
            return []
        self._cleared = response_id
        return [Send(ev.OutputAudioCleared(response_id=response_id))]

    # ------------------------------------------------------------------ internals
    def _again(self, item: _Item) -> list[SendAudio]:
        """``item``'s audio from the far end's last played position, in chunks."""
        rate = item.sample_rate
        start = min(2 * round(item.played_ms * rate / 1000), len(item.pcm) & ~1)
        step = 2 * (rate * _RESUME_CHUNK_MS // 1000)
        item_id = next(k for k, v in self._items.items() if v is item)
        out: list[SendAudio] = []
        for at in range(start, len(item.pcm), step):
            pcm = bytes(item.pcm[at : at + step])
            out.append(
                SendAudio(
                    response_id=item.response_id,
                    item_id=item_id,
                    epoch=item.epoch,
                    pcm=pcm,
                    sample_rate=rate,
                    audio_start_ms=at / 2 / rate * 1000,
                    duration_ms=len(pcm) / 2 / rate * 1000,
                    restart=not out,
                )
            )
        item.cut = False
        return out

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
            item = self._items[item_id]
            if item_id != self._far and not item.paused:  # (the far end may still play it)
                del self._items[item_id]
