"""Attachments: how a session sees the transport attached to it (:class:`Attachment`),
resume tokens (only a hash stored), the per-session event journal, and the bounded
outbound queue a transport may use.

A session outlives its transports (a WebSocket today; WebRTC, telephony or an engine-process
front end fit the same interface). Server events are stamped (``event_id``,
``server_event_seq``) when they are written to the socket, or at once while no socket is
attached, and every stamped event is journaled so a resumed socket can be sent what the
old one missed, in the original order with the original ids.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from duplex_server.protocol import events as ev
from duplex_server.protocol.codec import encode_server_event
from duplex_server.protocol.resume import new_resume_token as new_resume_token
from duplex_server.protocol.resume import token_matches as token_matches


# ---------------------------------------------------------------------------- attachment
class Attachment(Protocol):
    """What a live session needs of the transport attached to it; nothing more.

    The session calls these from the event loop (a transport's writer,
    :class:`~duplex_server.session.writer.QueuedWriter`, implements them). The transport in
    turn calls the session's ``receive_*``, ``audio.receive*``, ``next_frame``/``sent`` (if it
    stamps at write time), ``too_slow`` and ``detach``; the session never imports a transport.
    """

    def send_event(self, item: Outgoing) -> bool:
        """Queue a server event (stamped when written). False: over the output budget."""
        ...

    def send_stamped(self, data: bytes) -> None:
        """Queue bytes already stamped and journaled (a replay); never refused."""
        ...

    def purge_audio(self, below_epoch: int) -> int:
        """Drop queued audio of epochs below ``below_epoch`` (barge-in); how many."""
        ...

    def take_unsent(self) -> list[Outgoing]:
        """Everything queued and not yet written, removed from the queue."""
        ...

    def close(self, code: int, reason: str) -> None:
        """Close once what is queued has been written."""
        ...

    def replaced(self, data: bytes) -> None:
        """Another transport took the session over: drop what is queued, send ``data``
        (session.replaced, stamped for this transport only) and close."""
        ...

    @property
    def queued_bytes(self) -> int:
        """Output queued and not yet written (the backpressure state)."""
        ...


# ---------------------------------------------------------------------------- journal
@dataclass(slots=True)
class _Entry:
    seq: int
    data: bytes
    t: float


class Journal:
    """Stamped events kept until acknowledged, within ``max_bytes`` and ``max_age_s``.

    Entries dropped for size or age without an ack make a later resume from before them
    impossible: :meth:`replay_after` then returns ``None`` (``session.resync_required``).
    """

    def __init__(self, max_bytes: int, max_age_s: float) -> None:
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self.last_seq = 0
        self.bytes = 0
        self._entries: deque[_Entry] = deque()
        self._acked = 0
        self._lost_through = 0  # highest seq dropped before it was acknowledged

    def append(self, seq: int, data: bytes, now: float) -> None:
        self.last_seq = seq
        self._entries.append(_Entry(seq, data, now))
        self.bytes += len(data)
        self._expire(now)

    def _drop_first(self) -> None:
        entry = self._entries.popleft()
        self.bytes -= len(entry.data)
        if entry.seq > self._acked:
            self._lost_through = entry.seq

    def _expire(self, now: float) -> None:
        while self._entries and (
            self.bytes > self.max_bytes or now - self._entries[0].t > self.max_age_s
        ):
            self._drop_first()

    def ack(self, seq: int) -> None:
        self._acked = max(self._acked, min(seq, self.last_seq))
        while self._entries and self._entries[0].seq <= self._acked:
            entry = self._entries.popleft()
            self.bytes -= len(entry.data)

    @property
    def first_available(self) -> int:
        return self._entries[0].seq if self._entries else self.last_seq + 1

    def restart_at(self, seq: int) -> None:
        """A session taken over from another front end: numbering goes on after ``seq``;
        nothing before it can be replayed here."""
        self.last_seq = self._acked = self._lost_through = seq

    def replay_after(self, seq: int, now: float) -> list[bytes] | None:
        """Events after ``seq`` in order, or None if some were lost or ``seq`` is unknown."""
        self._expire(now)
        if seq > self.last_seq or seq < self._lost_through:
            return None
        if self._entries and seq + 1 < self._entries[0].seq:
            return None  # acknowledged past seq: the client claims less than it acked
        self.ack(seq)
        return [e.data for e in self._entries if e.seq > seq]


# ---------------------------------------------------------------------------- stamping
class Stamper:
    """Assigns ``server_event_seq`` (1, 2, 3, ...) and ``event_id`` and journals the event."""

    def __init__(self, session_id: str, journal: Journal) -> None:
        self._prefix = f"event_{session_id[5:17]}"
        self.journal = journal
        self.seq = 0
        self.beta = False
        #: False: events are numbered (their ``event_id``, the journal) but carry no
        #: ``server_event_seq`` (the GPT-Live wire has none; its events omit defaults)
        self.seq_on_wire = True

    def restart_at(self, seq: int) -> None:
        """A session taken over from another front end: numbering goes on after ``seq``
        (the journal too: nothing before it can be replayed here)."""
        self.seq = seq
        self.journal.restart_at(seq)

    def stamp(self, event: ev.ServerEvent, now: float) -> bytes:
        self.seq += 1
        seq = self.seq if self.seq_on_wire else 0
        data, _ = encode_server_event(
            event, event_id=f"{self._prefix}{self.seq:07d}", seq=seq, beta=self.beta
        )
        self.journal.append(self.seq, data, now)
        return data


# ---------------------------------------------------------------------------- outbound queue
@dataclass(slots=True)
class Outgoing:
    """One queued frame: a server event to stamp, or pre-stamped bytes (replay)."""

    event: ev.ServerEvent | None
    raw: bytes | None
    size: int
    epoch: int | None = None  # audio deltas: the epoch they belong to
    t_in: float = 0.0  # perf_counter when the engine output arrived (audio)
    pcm: bytes = b""  # audio deltas: the audio as PCM16 at the output rate (media transports)


@dataclass
class Outbox:
    """Bounded (bytes) outbound queue of one transport. Overflow = slow client."""

    max_bytes: int
    items: deque[Outgoing] = field(default_factory=deque)
    nbytes: int = 0
    wake: asyncio.Event = field(default_factory=asyncio.Event)

    def put(self, item: Outgoing) -> bool:
        """Queue an item; False if the queue would exceed its byte budget."""
        if self.nbytes + item.size > self.max_bytes and self.items:
            return False
        self.items.append(item)
        self.nbytes += item.size
        self.wake.set()
        return True

    def put_raw(self, data: bytes) -> None:
        """Queue pre-stamped bytes (replay, connection-level events); never refused."""
        self.items.append(Outgoing(None, data, len(data)))
        self.nbytes += len(data)
        self.wake.set()

    def pop(self) -> Outgoing | None:
        if not self.items:
            self.wake.clear()
            return None
        item = self.items.popleft()
        self.nbytes -= item.size
        return item

    def purge_audio(self, below_epoch: int) -> int:
        """Remove queued audio deltas of epochs below ``below_epoch``; returns how many."""
        keep: deque[Outgoing] = deque()
        dropped = 0
        for item in self.items:
            if item.epoch is not None and item.epoch < below_epoch:
                dropped += 1
                self.nbytes -= item.size
            else:
                keep.append(item)
        self.items = keep
        return dropped

    def drain(self) -> list[Outgoing]:
        out = list(self.items)
        self.items.clear()
        self.nbytes = 0
        return out
