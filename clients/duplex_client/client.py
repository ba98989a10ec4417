"""The asyncio duplex client: one session, one unbroken stream of typed server events.

>>> async with await DuplexClient.connect("ws://127.0.0.1:8000/v1/realtime") as client:
...     await client.update_session({"output_modalities": ["text"]})
...     await client.send_text("hello")
...     async for event in client.events():
...         if isinstance(event, ev.ResponseDone):
...             break

Events are the server event structs of :mod:`duplex_client.events` (the protocol's own
classes; decoded once, here, by :func:`decode_event`), the duplex extensions included: e.g.
``ev.DtmfEventReceived`` (a keypad digit of a phone call, ``event`` the key), or the
``usage`` of ``ev.SessionClosed``.

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
the server that held the session crashed, is delivered and the session goes on) or when
resuming fails (raises :class:`ConnectionLost`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import wave
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt
import soxr
import websockets
from websockets.asyncio.client import ClientConnection

from duplex_client import events as ev
from duplex_client.resend import InputLog

log = logging.getLogger(__name__)

_DECODER = msgspec.json.Decoder(ev.AnyServerEvent)
_ENCODER = msgspec.json.Encoder()
_TERMINAL = (ev.SessionClosed, ev.SessionExpired, ev.SessionReplaced, ev.ResyncRequired)
#: a resume refused with these is tried again (the load balancer may pick another front end)
_RETRY_CODES = frozenset({"server_draining", "engine_unavailable"})


def _ends_session(event: ev.AnyServerEvent) -> bool:
    """``session.resync_required`` after a front end crash (``front_end_lost``) does not end
    the session: it goes on, and the application re-reads what it needs."""
    if isinstance(event, ev.ResyncRequired):
        return event.reason != "front_end_lost"
    return isinstance(event, _TERMINAL)


AudioInput = bytes | npt.NDArray[np.int16] | npt.NDArray[np.float32] | npt.NDArray[np.float64]


def decode_event(data: str | bytes) -> ev.AnyServerEvent:
    """One server frame as its typed event; raises ``msgspec.ValidationError`` for an event
    this SDK does not know (a newer server's)."""
    event: ev.AnyServerEvent = _DECODER.decode(data)
    return event


class ConnectionLost(ConnectionError):
    """The connection dropped and could not be resumed."""


class SessionEnded(Exception):
    """``next_event`` after the stream ended (session closed, expired, replaced)."""


class SessionRefused(ConnectionError):
    """The server refused the session (auth, capacity) before ``session.created``.
    ``code``: the server's error code (``unauthorized``, ``resource_exhausted``,
    ``engine_unavailable``...) when it sent one."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


def to_pcm16(audio: AudioInput, rate: int, target_rate: int) -> bytes:
    """Mono int16 or float (-1..1) samples, or PCM16 bytes, at ``target_rate`` as PCM16 bytes."""
    if isinstance(audio, bytes):
        if rate == target_rate:
            return audio
        samples: npt.NDArray[Any] = np.frombuffer(audio, dtype="<i2")
    else:
        samples = np.asarray(audio)
    if samples.dtype.kind == "f":
        samples = (np.clip(samples, -1.0, 1.0) * 32767.0).astype(np.int16)
    if rate != target_rate:
        samples = soxr.resample(samples.astype(np.int16), rate, target_rate)
    return np.asarray(samples, dtype="<i2").tobytes()


def read_wav(path: str | Path) -> tuple[bytes, int]:
    """PCM16 mono bytes and sample rate of a WAV file (stdlib ``wave``; mono 16-bit only)."""
    with wave.open(str(path), "rb") as w:
        if w.getsampwidth() != 2 or w.getnchannels() != 1:
            raise ValueError(f"{path}: need mono 16-bit PCM WAV")
        return w.readframes(w.getnframes()), w.getframerate()


class DuplexClient:
    """A connected session. Build it with :meth:`connect`; close it with :meth:`close`."""

    def __init__(
        self,
        url: str,
        headers: dict[str, str],
        heartbeat_s: float,
        resume_attempts: int,
        resume_backoff_s: float,
    ) -> None:
        self.url = url
        self._headers = headers
        self._heartbeat_s = heartbeat_s
        self._resume_attempts = resume_attempts
        self._resume_backoff_s = resume_backoff_s
        self._ws: ClientConnection | None = None
        self._connected = asyncio.Event()
        self._queue: asyncio.Queue[ev.AnyServerEvent | BaseException | None] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False
        self._ended = False
        self._end = asyncio.Event()
        self.session_id = ""
        self.resume_token = ""
        self.resume_query = "intent=resume"
        self.last_seq = 0  # highest server_event_seq delivered
        self._acked = 0
        self.session: ev.SessionObj | None = None
        self.resumes = 0  # transparent resumes so far
        self.resumed_at: float | None = None  # time.monotonic() of the last resume
        self.duplicates_dropped = 0  # replayed events already delivered before a drop
        self.inputs = InputLog()  # numbered input messages, until the server has them
        self.input_resent = 0  # input messages sent again after a reconnect
        self._resent_upto = 0  # input messages up to this number were sent by a resume

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
        self = cls(url, headers, heartbeat_s, resume_attempts, resume_backoff_s)
        ws = await self._open(open_timeout_s)
        first = await asyncio.wait_for(self._recv_event(ws), open_timeout_s)
        if not isinstance(first, ev.SessionCreated):
            await ws.close()
            if isinstance(first, ev.Error):
                err = first.error
                raise SessionRefused(
                    f"the server refused the session: {err.message} ({err.code})", err.code
                )
            raise SessionRefused(f"expected session.created, got {type(first).__name__}")
        self.session_id, self.resume_token = first.session.id, first.resume_token
        self.resume_query = first.resume_query  # where a load balancer sends our resume
        self.session = first.session
        self._attach(ws)
        self._deliver(first)
        self._tasks = [
            asyncio.create_task(self._read_loop(), name=f"duplex-read-{self.session_id}"),
            asyncio.create_task(self._heartbeat_loop(), name=f"duplex-beat-{self.session_id}"),
        ]
        return self

    async def _open(self, timeout_s: float, *, resume: bool = False) -> ClientConnection:
        url = self.url
        if resume:  # the server waits for session.resume instead of opening a new session;
            # the query names the front end that owns the session (behind a load balancer)
            url += ("&" if "?" in url else "?") + self.resume_query
        try:
            return await websockets.connect(
                url,
                additional_headers=self._headers,
                max_size=None,
                open_timeout=timeout_s,
                ping_interval=None,  # the protocol heartbeat keeps the lease alive
            )
        except websockets.InvalidStatus as exc:
            raise SessionRefused(f"handshake refused: HTTP {exc.response.status_code}") from None

    async def _recv_event(self, ws: ClientConnection) -> ev.AnyServerEvent:
        while True:
            data = await ws.recv()
            try:
                return decode_event(data)
            except msgspec.ValidationError as exc:  # a newer server's event: skip it
                log.debug("skipping undecodable server event: %s", exc)

    def _attach(self, ws: ClientConnection) -> None:
        self._ws = ws
        self._connected.set()

    async def close(self) -> None:
        """Close the session (``session.close``) and the socket; idempotent."""
        if self._closing:
            return
        self._closing = True
        ws = self._ws
        if ws is not None and self._connected.is_set() and not self._ended:
            with contextlib.suppress(websockets.ConnectionClosed):
                await ws.send(_ENCODER.encode(ev.SessionClose()).decode())
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._end.wait(), 5.0)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._ws is not None:
            await self._ws.close()
        self._queue.put_nowait(None)

    async def __aenter__(self) -> DuplexClient:
        return self

    async def __aexit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    # ------------------------------------------------------------------ events
    async def events(self) -> AsyncIterator[ev.AnyServerEvent]:
        """Every server event once, in order, across reconnects; ends with the session."""
        while True:
            item = await self._queue.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    async def next_event(self, timeout_s: float | None = None) -> ev.AnyServerEvent:
        item = await asyncio.wait_for(self._queue.get(), timeout_s)
        if item is None:
            self._queue.put_nowait(None)  # keep the end visible to later calls
            raise SessionEnded(self.session_id)
        if isinstance(item, BaseException):
            raise item
        return item

    def _deliver(self, event: ev.AnyServerEvent) -> None:
        seq = event.server_event_seq
        if seq and seq <= self.last_seq:
            self.duplicates_dropped += 1
            return
        if seq:
            self.last_seq = seq
        if isinstance(event, ev.SessionUpdated):
            self.session = event.session
        self._queue.put_nowait(event)
        if _ends_session(event):
            self._ended = True
            self._end.set()
            self._queue.put_nowait(None)

    async def _read_loop(self) -> None:
        while not self._ended:
            ws = self._ws
            assert ws is not None
            try:
                event = await self._recv_event(ws)
            except websockets.ConnectionClosed:
                if self._closing or self._ended:
                    break
                self._connected.clear()
                try:
                    await self._resume()
                except ConnectionLost as exc:
                    self._ended = True
                    self._end.set()
                    self._queue.put_nowait(exc)
                    break
                continue
            if isinstance(event, ev.SessionResumed):
                self.resume_token = event.resume_token
                continue
            self._deliver(event)

    async def _resume(self) -> None:
        """Reconnect and resume the session; replayed events are de-duplicated by seq."""
        delay = self._resume_backoff_s
        last_error = "connection dropped"
        for attempt in range(1, self._resume_attempts + 1):
            try:
                ws = await self._open(10.0, resume=True)
            except (OSError, TimeoutError, SessionRefused, websockets.InvalidHandshake) as exc:
                last_error = f"{type(exc).__name__}: {exc}"
                log.info("resume attempt %d failed: %s", attempt, last_error)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            resume = ev.SessionResume(
                session_id=self.session_id,
                resume_token=self.resume_token,
                last_received_server_event_seq=self.last_seq,
            )
            try:
                await ws.send(_ENCODER.encode(resume).decode())
                # The server replays journaled events, then confirms with session.resumed.
                while True:
                    reply = await asyncio.wait_for(self._recv_event(ws), 10.0)
                    if isinstance(reply, ev.SessionResumed):
                        break
                    if isinstance(reply, ev.Error) and reply.error.code in _RETRY_CODES:
                        raise TimeoutError(f"resume refused for now: {reply.error.code}")
                    if isinstance(reply, ev.Error | ev.SessionClosed | ev.SessionExpired):
                        await ws.close()
                        self._deliver(reply)
                        raise ConnectionLost(f"resume refused: {reply!r}")
                    self._deliver(reply)
            except (websockets.ConnectionClosed, TimeoutError) as exc:
                last_error = f"{type(exc).__name__}: {exc}"
                await ws.close()
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            try:
                await self._resend_input(ws, reply.last_input_seq)
            except websockets.ConnectionClosed as exc:
                last_error = f"{type(exc).__name__}: {exc}"
                await asyncio.sleep(delay)
                continue
            self.resume_token = reply.resume_token
            self.last_seq = max(self.last_seq, reply.server_event_seq)  # not shown to the user
            self.resumes += 1
            self.resumed_at = time.monotonic()
            self._attach(ws)
            log.info("session %s resumed (%d replayed)", self.session_id, reply.replayed)
            return
        raise ConnectionLost(f"could not resume session {self.session_id}: {last_error}")

    async def _resend_input(self, ws: ClientConnection, server_seq: int | None) -> None:
        """Send again, in order, the input the resumed session lacks (None: a server
        without input numbering; nothing is re-sent, as before)."""
        if server_seq is None:
            return
        for seq, data in self.inputs.after(server_seq):
            await ws.send(data)
            self.input_resent += 1
            self._resent_upto = seq

    async def _heartbeat_loop(self) -> None:
        while not self._ended:
            await asyncio.sleep(self._heartbeat_s)
            with contextlib.suppress(ConnectionLost):
                await self.send_event(ev.SessionHeartbeat())
                if self.last_seq > self._acked:
                    self._acked = self.last_seq
                    await self.send_event(ev.SessionEventAck(seq=self.last_seq))

    # ------------------------------------------------------------------ sending
    async def _send(self, data: str | bytes) -> None:
        while True:
            if self._ended:
                raise ConnectionLost("the session has ended")
            await self._connected.wait()
            ws = self._ws
            assert ws is not None
            try:
                await ws.send(data)
                return
            except websockets.ConnectionClosed:
                self._connected.clear()  # the reader resumes; send again on the new socket

    async def _send_input(self, seq: int, data: str | bytes) -> None:
        """Send input message ``seq``; a socket that breaks meanwhile is resumed, and the
        resume sends the message again if the server lacks it (never twice)."""
        self.inputs.add(seq, data)
        while True:
            if self._ended:
                raise ConnectionLost("the session has ended")
            await self._connected.wait()
            if seq <= self._resent_upto:
                return  # the resume sent it
            ws = self._ws
            assert ws is not None
            try:
                await ws.send(data)
                return
            except websockets.ConnectionClosed:
                self._connected.clear()

    async def send_event(self, event: ev.ClientEvent) -> None:
        if isinstance(event, ev.InputAudioBufferAppend | ev.ConversationItemCreate):
            seq = self.inputs.next_seq()
            if event.input_seq is None:
                event = msgspec.structs.replace(event, input_seq=seq)
            await self._send_input(seq, _ENCODER.encode(event).decode())
            return
        await self._send(_ENCODER.encode(event).decode())

    async def update_session(self, session: ev.SessionParam | Mapping[str, Any]) -> None:
        """Send ``session.update`` (a SessionParam or its JSON shape)."""
        param = (
            session
            if isinstance(session, ev.SessionParam)
            else msgspec.convert(session, ev.SessionParam)
        )
        await self.send_event(ev.SessionUpdate(session=param))

    @property
    def input_rate(self) -> int:
        """Sample rate of the session's input format (binary frames are sent in it)."""
        if self.session is None:
            return 24000
        return self.session.audio.input.format.rate

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
            await self._send_input(self.inputs.next_seq(), pcm[offset : offset + step])
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
