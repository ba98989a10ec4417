"""Input turns (pure): the session's input audio clock, the prefix-padding ring, the speech
item in progress, and the barge-in guards.

:class:`InputTurns` takes processed input (engine-rate PCM16 and the VAD decisions it
produced) and returns :data:`TurnStep` decisions in order; the client input handler
(:mod:`~duplex_server.protocol.client_input`) turns them into engine calls and server events
(the response tracker owns the response lifecycle). It knows nothing of responses except
what :func:`should_interrupt` is told.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from duplex_contract.audio import INPUT_RATE, input_bytes, input_ms
from duplex_server.protocol import vad_events
from duplex_server.protocol.events import TurnDetection
from duplex_server.protocol.interruption import Rule, Speech, decide
from duplex_server.protocol.vad_events import VadEvent, VadPause, VadResume, VadStart, VadStop

_ONSETS = (vad_events.VadOnset, vad_events.VadOnsetLost)
#: idle audio kept beyond the prefix padding (a speech onset reaches back this far)
_IDLE_KEEP_MS = 1000.0


@dataclass(frozen=True, slots=True)
class AudioReady:
    """Audio to append to the engine's input buffer now; ``stream_ms``: where it starts on
    the session's input clock (``InputTurns.input_ms``)."""

    pcm: bytes
    stream_ms: float


@dataclass(frozen=True, slots=True)
class SpeechBegan:
    item_id: str
    audio_start_ms: float


@dataclass(frozen=True, slots=True)
class Speaking:
    """Speech is in progress and has lasted ``speech_ms`` so far (a barge-in candidate)."""

    speech_ms: float


@dataclass(frozen=True, slots=True)
class SpeechEnded:
    """The turn ended: commit ``item_id``; ``speech_ms`` is the utterance's length."""

    item_id: str
    audio_end_ms: float
    speech_ms: float


@dataclass(frozen=True, slots=True)
class Paused:
    """A pause inside speech: the engine may transcribe ahead of the commit. ``at_ms``:
    the VAD's ``VadPause.at_ms``, the pause's name to the input lane (``EndTurn``)."""

    at_ms: float = 0.0


@dataclass(frozen=True, slots=True)
class Resumed:
    """Speech came back after a pause: drop that speculation."""


@dataclass(frozen=True, slots=True)
class Onset:
    """A speech onset heard, not yet speech (``heard``; ``confirm`` pauses the answer on
    it), or lost before it was (a pause on it is taken back)."""

    heard: bool


TurnStep = AudioReady | SpeechBegan | Speaking | SpeechEnded | Paused | Resumed | Onset


def should_interrupt(
    td: TurnDetection | None,
    speech_ms: float,
    *,
    response_active: bool,
    response_started_ms: float | None,
    now_ms: float,
) -> bool:
    """Does ``speech_ms`` of user speech interrupt the response in progress? The one rule
    (:func:`~duplex_server.protocol.interruption.decide`) in ``immediate`` mode.

    A pending response (its user turn still being transcribed) is interrupted too: the
    engine keeps that turn's words in the conversation (transcribed, not answered), so a
    pause inside a sentence ends in one answer to the whole sentence, not two.
    """
    rule = Rule.of(td, server_playout=False)
    if rule is None or not response_active:
        return False
    window = rule.window_open(response_started_ms, now_ms)
    return decide(rule.immediate(), Speech(speech_ms), window_open=window) == "stop"


class InputTurns:
    """One session's input side; ``new_item_id`` names the user item of a speech onset."""

    def __init__(self, new_item_id: Callable[[], str]) -> None:
        self._new_item_id = new_item_id
        self.input_ms = 0.0  # session audio clock (processed input)
        self.uncommitted_ms = 0.0  # audio appended to the engine since the last commit
        self.uncommitted_text = False
        self.speech_item: str | None = None  # user item of the speech in progress
        self._onset_ms: float | None = None
        self._ring: deque[bytes] = deque()
        self._ring_bytes = 0

    @property
    def buffered(self) -> bool:
        """Is there input to commit (appended or still in the ring)?"""
        return self.uncommitted_ms > 0 or self._ring_bytes > 0

    def reset(self) -> None:
        """Forget the ring and the speech in progress (format change, buffer clear)."""
        self._ring.clear()
        self._ring_bytes = 0
        self.speech_item = None
        self._onset_ms = None

    def committed(self) -> None:
        """The input so far was committed (or cleared) in the engine."""
        self.uncommitted_ms = 0.0
        self.uncommitted_text = False

    def take_speech_item(self) -> str | None:
        """A manual commit: end the speech in progress; its item id, if any."""
        item = self.speech_item
        self.speech_item = None
        self._onset_ms = None
        return item

    def flush(self, until_ms: float | None = None) -> list[TurnStep]:
        """Send everything in the ring to the engine (``until_ms``: only the audio before
        that point of the input clock; the rest stays in the ring)."""
        if not self._ring_bytes:
            return []
        data = b"".join(self._ring)
        self._ring.clear()
        self._ring_bytes = 0
        start_ms = self.input_ms - input_ms(len(data))
        if until_ms is not None:
            # whole samples, rounded: the clock is a float sum of the appends' lengths
            keep = min(len(data), 2 * round(max(0.0, self.input_ms - until_ms) * INPUT_RATE / 1000))
            if keep:
                data, rest = data[: len(data) - keep], data[len(data) - keep :]
                self._ring.append(rest)
                self._ring_bytes = len(rest)
            if not data:
                return []
        self.uncommitted_ms += input_ms(len(data))
        return [AudioReady(data, start_ms)]

    def on_audio(
        self, pcm: bytes, vad: Sequence[VadEvent], td: TurnDetection | None
    ) -> list[TurnStep]:
        """One processed chunk (engine input rate) and the VAD decisions it produced."""
        chunk_ms = input_ms(len(pcm))
        self.input_ms += chunk_ms
        if td is None:  # no turn detection: everything goes to the engine at once
            if not pcm:
                return []
            self.uncommitted_ms += chunk_ms
            return [AudioReady(pcm, self.input_ms - chunk_ms)]
        # server VAD: idle audio waits in a ring (prefix padding); speech goes to the engine
        self._ring.append(pcm)
        self._ring_bytes += len(pcm)
        out: list[TurnStep] = []
        for v in vad:
            if isinstance(v, VadStart) and self.speech_item is None:
                self.speech_item = self._new_item_id()
                self._onset_ms = v.onset_ms
                start = max(0.0, v.audio_start_ms)
                self._trim(keep_ms=self.input_ms - start)
                out.append(SpeechBegan(self.speech_item, start))
            elif isinstance(v, VadStop) and self.speech_item is not None:
                # the turn ends where the VAD decided it; the rest of the append stays in the
                # ring (the next turn's padding), so no turn depends on the append size
                out += self.flush(until_ms=v.at_ms)
                assert self._onset_ms is not None
                # A whole utterance can arrive in one processed batch (a backlog): it still
                # interrupts, judged by its own length, before its turn is committed.
                speech_ms = v.audio_end_ms - self._onset_ms
                item_id = self.speech_item
                self.speech_item = None
                self._onset_ms = None
                out.append(SpeechEnded(item_id, v.audio_end_ms, speech_ms))
            elif isinstance(v, VadPause) and self.speech_item is not None:
                # the speech up to the VAD's pause point reaches the engine first, and no
                # more: the pause's guess transcribes the same audio whatever the append
                # size (the rest of the append follows right after the pause)
                out += self.flush(until_ms=v.at_ms)
                out.append(Paused(v.at_ms))
            elif isinstance(v, VadResume) and self.speech_item is not None:
                out.append(Resumed())
            elif isinstance(v, _ONSETS) and self.speech_item is None:
                out.append(Onset(isinstance(v, vad_events.VadOnset)))
        if self.speech_item is not None:
            out += self.flush()
            assert self._onset_ms is not None
            out.append(Speaking(self.input_ms - self._onset_ms))
        else:
            self._trim(keep_ms=td.prefix_padding_ms + _IDLE_KEEP_MS)
        return out

    def _trim(self, keep_ms: float) -> None:
        keep = input_bytes(keep_ms)
        while self._ring and self._ring_bytes - len(self._ring[0]) >= keep:
            self._ring_bytes -= len(self._ring.popleft())
        if self._ring and self._ring_bytes > keep:
            cut = (self._ring_bytes - keep) & ~1
            self._ring[0] = self._ring[0][cut:]
            self._ring_bytes -= cut
