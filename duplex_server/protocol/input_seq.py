"""Client input sequence numbers (an extension): input arrives exactly once across reconnects.

Every input message of a session (a binary audio frame, ``input_audio_buffer.append``,
``conversation.item.create``) has a sequence number: the JSON events may carry it as
``input_seq``; a message without one (every binary frame, and the events of a plain OpenAI
client) gets the next number implicitly. A message whose explicit ``input_seq`` is not above
the highest one received is a re-send of input the session already has and is dropped.
``session.resumed`` tells the client the highest number received (``last_input_seq``), so a
client re-sends only what the server never got (docs/protocol.md, "Input exactly once").

The engine keeps the highest number whose input reached it (``AppendCall.seq``); a front
end that takes a session over after a crash starts from it (:meth:`InputSequence.adopt`).
Audio reaches the engine after the input lane (resampling, VAD), so an append carries the
number of the newest message whose audio it completes (:meth:`InputSequence.processed`).
Pure state, no I/O.
"""

from __future__ import annotations

from collections import deque

_TOLERANCE_MS = 1.0  # resampler rounding between the received and the processed clock


class InputSequence:
    """The session's input numbering: what was received, and what reached the engine."""

    def __init__(self) -> None:
        self.received = 0  # highest input_seq received (explicit or implicit)
        self.sent = 0  # highest input_seq given to the engine with an append
        self.dropped = 0  # re-sent messages dropped (duplicates)
        self._received_ms = 0.0  # input audio received, on the processed clock's scale
        self._marks: deque[tuple[float, int]] = deque()  # (audio end ms, seq) not yet sent

    def accept(self, explicit: int | None) -> int | None:
        """Number an input message; None if it is a re-send of one already received."""
        if explicit is None:
            self.received += 1
            return self.received
        if explicit <= self.received:
            self.dropped += 1
            return None
        self.received = explicit
        return explicit

    def audio(self, seq: int, duration_ms: float) -> None:
        """Message ``seq`` carried ``duration_ms`` of audio (it goes through the input lane)."""
        self._received_ms += duration_ms
        self._marks.append((self._received_ms, seq))

    def processed(self, processed_ms: float) -> int | None:
        """Audio up to ``processed_ms`` goes to the engine: the newest message it completes
        (for the append's ``seq``), or None when it completes none not already sent."""
        newest = None
        while self._marks and self._marks[0][0] <= processed_ms + _TOLERANCE_MS:
            newest = self._marks.popleft()[1]
        return self._to_engine(newest)

    def text(self, seq: int) -> int | None:
        """A text item or tool output (message ``seq``) goes to the engine now."""
        return self._to_engine(seq)

    def _to_engine(self, seq: int | None) -> int | None:
        # the engine drops an append whose seq is not above the last one it took
        if seq is None or seq <= self.sent:
            return None
        self.sent = seq
        return seq

    def adopt(self, engine_seq: int) -> None:
        """A taken-over session: the engine has every message up to ``engine_seq``."""
        self.received = self.sent = engine_seq
        self._marks.clear()
