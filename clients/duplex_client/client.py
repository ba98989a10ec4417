"""The asyncio duplex client: one session, one unbroken stream of typed server events.

>>> async with await DuplexClient.connect("ws://127.0.0.1:8000/v1/realtime") as client:
...     await client.update_session({"output_modalities": ["text"]})
...     await client.send_text("hello")
...     async for event in client.events():
...         if isinstance(event, ev.ResponseDone):
...             break

Events are the server event structs of :mod:`duplex_client.events` (the protocol's own
classes; decoded once, by :func:`duplex_client.wire.decode_event`), the duplex extensions
included: e.g. ``ev.DtmfEventReceived`` (a keypad digit of a phone call, ``event`` the key),
or the ``usage`` of ``ev.SessionClosed``.

The client holds three objects, one job each: its
:class:`~duplex_client.connection.Connection` (the socket, the reader, the heartbeat, the
resume), its :class:`~duplex_client.stream.EventStream` (what ``events()`` reads) and its
:class:`~duplex_client.resend.InputLog` (the input the server may lack after a drop).

A dropped connection is resumed transparently: the client reconnects, sends
``session.resume{session_id, resume_token, last_received_server_event_seq}`` (on a
``?intent=resume`` socket, so the server opens no new session), stores the
rotated token, and drops replayed events it already delivered (by ``server_event_seq``), so
``events()`` never shows a gap or a duplicate. Sends made while reconnecting wait for the
new socket. Input is sent exactly once across reconnects: every input message (audio frame,
append, item create) is numbered and kept in an :class:`~duplex_client.resend.InputLog`
until ``session.resumed.last_input_seq`` shows the server has it; what it lacks is sent
again on the new socket before anything else (docs/protocol.md, "Input exactly once"). A
``session.handover`` (the front end is draining for a deploy) is resumed the same way,
through the load balancer, on another front end. A heartbeat task sends
``session.heartbeat`` and acknowledges received events (``session.event_ack``) so the
server can trim its journal.

The stream ends after ``session.closed``, ``session.expired``, ``session.replaced``,
``session.resync_required`` (each delivered first; one with reason ``front_end_lost``, after
the server that held the session crashed, or ``engine_restarted``, after the engine did, is
delivered and the session goes on) or when
resuming fails (raises :class:`~duplex_client.errors.ConnectionLost`). Counters of all this
are on the client (``resumes``, ``resumed_at``, ``duplicates_dropped``) and on the objects
that count (``client.stream.last_seq``, ``client.inputs.resent``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import msgspec

from duplex_client import events as ev
from duplex_client.audio_input import AudioInput, read_wav, to_pcm16
from duplex_client.connection import Connection, ResumePolicy
from duplex_client.errors import SessionEnded
from duplex_client.resend import InputLog
from duplex_client.stream import EventStream
from duplex_client.wire import encode_event


class DuplexClient:
    """A connected session. Build it with :meth:`connect`; close it with :meth:`close`."""

    def __init__(self, connection: Connection, stream: EventStream, inputs: InputLog) -> None:
        self.connection = connection
        self.stream = stream
        self.inputs = inputs  # numbered input messages, until the server has them
        self.url = connection.url
        self.session_id = connection.session_id
        self.resume_query = connection.resume_query

    # ------------------------------------------------------------------ connect / close
    @classmethod
    async def connect(
        cls,
        url: str,
        *,
        api_key: str | None = None,
        heartbeat_s: float = 10.0,
        resume_attempts: int = 5,
        resume_backoff_s: float = 0.2,
        open_timeout_s: float = 10.0,
    ) -> DuplexClient:
        """Open a session; returns once ``session.created`` arrived."""
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        stream, inputs = EventStream(), InputLog()
        policy = ResumePolicy(attempts=resume_attempts, backoff_s=resume_backoff_s)
        connection = Connection(url, headers, stream=stream, inputs=inputs, policy=policy)
        created = await connection.open_session(open_timeout_s)
        stream.deliver(created)
        connection.start(heartbeat_s)
        return cls(connection, stream, inputs)

    async def close(self) -> None:
        """Close the session (``session.close``) and the socket; idempotent."""
        if self.connection.closing:
            return
        await self.connection.close()
        self.stream.finish()

    async def __aenter__(self) -> DuplexClient:
        return self

    async def __aexit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    # ------------------------------------------------------------------ state
    @property
    def resume_token(self) -> str:
        """The token the next resume presents (rotated by every resume)."""
        return self.connection.resume_token

    @property
    def resumes(self) -> int:
        """Transparent resumes so far."""
        return self.connection.resumes

    @property
    def resumed_at(self) -> float | None:
        """``time.monotonic()`` of the last resume."""
        return self.connection.resumed_at

    @property
    def duplicates_dropped(self) -> int:
        """Replayed events already delivered before a drop (not shown twice)."""
        return self.stream.duplicates_dropped

    @property
    def session(self) -> ev.SessionObj | None:
        """The effective session, as the last ``session.created`` / ``.updated`` said."""
        return self.stream.session

    @property
    def input_rate(self) -> int:
        """Sample rate of the session's input format (binary frames are sent in it)."""
        if self.session is None:
            return 24000
        return self.session.audio.input.format.rate

    # ------------------------------------------------------------------ events
    def events(self) -> AsyncIterator[ev.AnyServerEvent]:
        """Every server event once, in order, across reconnects; ends with the session."""
        return self.stream.events()

    async def next_event(self, timeout_s: float | None = None) -> ev.AnyServerEvent:
        event = await self.stream.next(timeout_s)
        if event is None:
            raise SessionEnded(self.session_id)
        return event

    # ------------------------------------------------------------------ sending
    async def send_event(self, event: ev.ClientEvent) -> None:
        if isinstance(event, ev.InputAudioBufferAppend | ev.ConversationItemCreate):
            seq = self.inputs.next_seq()
            if event.input_seq is None:
                event = msgspec.structs.replace(event, input_seq=seq)
            await self.connection.send(encode_event(event), input_seq=seq)
            return
        await self.connection.send(encode_event(event))

    async def update_session(self, session: ev.SessionParam | Mapping[str, Any]) -> None:
        """Send ``session.update`` (a SessionParam or its JSON shape)."""
        param = (
            session
            if isinstance(session, ev.SessionParam)
            else msgspec.convert(session, ev.SessionParam)
        )
        await self.send_event(ev.SessionUpdate(session=param))

    async def send_audio(
        self,
        audio: AudioInput,
        sample_rate: int | None = None,
        *,
        realtime: bool = False,
        chunk_ms: float = 20.0,
    ) -> None:
        """Send mono audio as binary frames in the session input format (pcm16).

        ``sample_rate`` is the rate of ``audio`` (default: the session input rate); it is
        resampled with soxr when it differs. ``realtime`` paces the frames like a microphone.
        """
        rate = self.input_rate
        pcm = to_pcm16(audio, sample_rate or rate, rate)
        step = max(2, int(rate * chunk_ms / 1000) * 2)
        start = time.monotonic()
        for i, offset in enumerate(range(0, len(pcm), step)):
            await self.connection.send(pcm[offset : offset + step], self.inputs.next_seq())
            if realtime:
                due = start + (i + 1) * chunk_ms / 1000
                await asyncio.sleep(max(0.0, due - time.monotonic()))

    async def send_wav(self, path: str | Path, *, realtime: bool = True) -> None:
        pcm, rate = read_wav(path)
        await self.send_audio(pcm, rate, realtime=realtime)

    async def send_text(self, text: str, *, respond: bool = True) -> None:
        """A user text message (``conversation.item.create``), then ``response.create``."""
        part = ev.ContentPartParam(type="input_text", text=text)
        await self.send_event(ev.ConversationItemCreate(item=ev.ItemParam(content=[part])))
        if respond:
            await self.create_response()

    async def commit(self) -> None:
        await self.send_event(ev.InputAudioBufferCommit())

    async def clear_input(self) -> None:
        await self.send_event(ev.InputAudioBufferClear())

    async def create_response(self) -> None:
        await self.send_event(ev.ResponseCreate())

    async def cancel_response(self) -> None:
        await self.send_event(ev.ResponseCancel())

    async def barge_in(self) -> None:
        """Interrupt the assistant now (extension ``barge_in``)."""
        await self.send_event(ev.BargeIn())

    async def ack_playback(self, item_id: str, played_ms: float) -> None:
        """Tell the server how much of an assistant item was actually played."""
        await self.send_event(ev.PlaybackAck(item_id=item_id, played_ms=played_ms))
