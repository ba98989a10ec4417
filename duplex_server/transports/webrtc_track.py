"""The server's WebRTC audio track: reply audio paced at real time, 20 ms a frame.

:class:`ReplyTrack` is an aiortc ``MediaStreamTrack``: the call queues each reply chunk
(resampled to 48 kHz), and aiortc pulls a frame every 20 ms (:meth:`ReplyTrack.recv`, paced
by the track's own clock), silence between replies. As it plays, the track tells its
:class:`TrackListener` (the call): ``output_audio_buffer.started`` / ``.stopped`` when a
response's audio begins and ends playing, how far each item has played and how much audio
still waits on the track (the call reports both to the session core: ``Played``), and the PCM
played (the echo canceller's reference). A barge-in flushes the queue at once.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from aiortc import MediaStreamTrack
from aiortc.mediastreams import MediaStreamError
from av import AudioFrame

from audio_kit.pcm import StreamResampler
from duplex_server.protocol import events as ev

TRACK_RATE = 48000
PTIME_S = 0.02
TRACK_FRAME = int(TRACK_RATE * PTIME_S)  # 960 samples
BYTES_PER_MS = TRACK_RATE / 500  # PCM16 mono


class TrackListener(Protocol):
    """What the track tells the call it plays for."""

    def emit(self, event: ev.ServerEvent) -> None:
        """A server event (``output_audio_buffer.started`` / ``.stopped``)."""
        ...

    def played(self, pcm: bytes) -> None:
        """One frame of PCM16 at ``TRACK_RATE`` went out (silence included)."""
        ...

    def audio_played(self, item_id: str, ms: float, queued_ms: float) -> None:
        """``item_id`` has played through ``ms``; ``queued_ms`` more waits on the track."""
        ...


@dataclass
class TrackChunk:
    response_id: str
    item_id: str
    start_ms: float  # the chunk's offset in its item's audio
    pcm: bytes  # PCM16 mono at TRACK_RATE
    offset: int = 0  # bytes already played


class ReplyTrack(MediaStreamTrack):
    """The server's audio track: reply audio at real time, silence between replies."""

    kind = "audio"

    def __init__(self, listener: TrackListener) -> None:
        super().__init__()
        self.listener = listener
        self.queue: deque[TrackChunk] = deque()
        self.playing: str | None = None  # response whose audio is on the track
        self.done: set[str] = set()  # responses whose audio has all been queued
        self.queued_bytes = 0  # of the queue, not yet played
        self._resamplers: dict[int, StreamResampler] = {}
        self._start = 0.0
        self._pts = 0

    def enqueue(self, event: ev.AudioDelta, pcm: bytes, rate: int) -> bool:
        """Queue the audio to play; False if the resampler held all of it back."""
        if rate != TRACK_RATE:
            res = self._resamplers.get(rate)
            if res is None:
                res = self._resamplers[rate] = StreamResampler(rate, TRACK_RATE)
            pcm = res.process(pcm)
        if pcm:
            self.queue.append(
                TrackChunk(event.response_id, event.item_id, event.audio_start_ms, pcm)
            )
            self.queued_bytes += len(pcm)
        return bool(pcm)

    def finish(self, response_id: str) -> None:
        """The response's audio is all queued: drain the resamplers' tails into it."""
        self.done.add(response_id)
        last = self.queue[-1] if self.queue else None
        for res in self._resamplers.values():
            tail = res.flush()
            if tail and last is not None and last.response_id == response_id:
                last.pcm += tail
                self.queued_bytes += len(tail)
        self._resamplers.clear()

    def flush(self) -> bool:
        """Barge-in: drop everything not yet played; True if audio was dropped."""
        had = bool(self.queue)
        self.queue.clear()
        self.queued_bytes = 0
        self._resamplers.clear()
        self.playing = None
        return had

    async def recv(self) -> AudioFrame:
        if self.readyState != "live":
            raise MediaStreamError
        if self._pts:
            wait = self._start + self._pts / TRACK_RATE - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
        else:
            self._start = time.monotonic()
        pcm = self._take(TRACK_FRAME * 2)
        frame = AudioFrame(format="s16", layout="mono", samples=TRACK_FRAME)
        frame.planes[0].update(pcm)
        frame.pts = self._pts
        frame.sample_rate = TRACK_RATE
        self._pts += TRACK_FRAME
        self.listener.played(pcm)
        return frame

    def _take(self, nbytes: int) -> bytes:
        out = bytearray()
        listener = self.listener
        while len(out) < nbytes and self.queue:
            chunk = self.queue[0]
            if self.playing != chunk.response_id:
                self.playing = chunk.response_id
                listener.emit(ev.OutputAudioStarted(response_id=chunk.response_id))
            part = chunk.pcm[chunk.offset : chunk.offset + nbytes - len(out)]
            out += part
            chunk.offset += len(part)
            self.queued_bytes -= len(part)
            played_ms = chunk.start_ms + chunk.offset / BYTES_PER_MS
            listener.audio_played(chunk.item_id, played_ms, self.queued_bytes / BYTES_PER_MS)
            if chunk.offset >= len(chunk.pcm):
                self.queue.popleft()
        playing = self.playing
        if playing is not None and playing in self.done:
            if not self.queue or self.queue[0].response_id != playing:
                self.done.discard(playing)
                self.playing = None
                listener.emit(ev.OutputAudioStopped(response_id=playing))
        return bytes(out) + b"\x00" * (nbytes - len(out))
