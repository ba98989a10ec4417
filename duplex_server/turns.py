"""The input lane of a session: decode the wire format, resample to 16 kHz (soxr), run the
VAD, all in a worker thread (never on the event loop), one chunk batch at a time in order.

The lane turns raw client audio into ``(pcm16 16 kHz, [VadStart | VadStop])`` for the
protocol core, which owns the barge-in policy (minimum speech before interrupting, the
uninterruptible window at the start of a response: see ``protocol/session.py``).

Back-pressure: the lane holds at most ``max_backlog`` bytes of unprocessed audio; an append
beyond that is refused with ``input_backpressure`` and dropped (the client is told).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Literal

from duplex_server.protocol.codec import AudioFormat, g711_to_pcm16
from duplex_server.protocol.events import TurnDetection
from duplex_server.protocol.session import VadEvent, VadPause, VadResume, VadStart, VadStop
from engine.audio import StreamResampler
from engine.stages.vad_silero import VadSegmenter, VadStream, make_vad

log = logging.getLogger(__name__)

ENGINE_RATE = 16000
#: VAD chunks of speech needed before speech_started (the segmenter's min_speech_ms).
MIN_SPEECH_MS = 64.0
#: Silence inside speech after which the engine transcribes speculatively (``input.pause``),
#: so the transcript is ready when silence_duration_ms later ends the turn. Capped at half the
#: silence window. Speech that resumes drops the speculation (``input.resume``).
SPECULATE_AFTER_MS = 96.0


class InputProcessor:
    """Sync and CPU-bound: wire bytes -> PCM16 16 kHz + VAD events. One per session."""

    def __init__(
        self,
        fmt: AudioFormat,
        turn_detection: TurnDetection | None,
        vad_backend: Literal["silero", "energy"],
    ) -> None:
        self.format = fmt
        self.turn_detection = turn_detection
        self._resampler = StreamResampler(fmt.rate, ENGINE_RATE)
        self._vad: VadStream | None = None
        if turn_detection is not None:
            segmenter = VadSegmenter(
                threshold=max(turn_detection.threshold, 0.01),
                min_speech_ms=MIN_SPEECH_MS,
                silence_duration_ms=float(turn_detection.silence_duration_ms),
                prefix_padding_ms=float(turn_detection.prefix_padding_ms),
                pause_ms=min(SPECULATE_AFTER_MS, turn_detection.silence_duration_ms / 2),
            )
            self._vad = VadStream(make_vad(vad_backend), segmenter)

    def process(self, data: bytes, origin_ms: float) -> tuple[bytes, list[VadEvent]]:
        """Decode and resample ``data``; VAD times are offset by ``origin_ms``."""
        if self.format.codec != "pcm16":
            data = g711_to_pcm16(data, self.format.codec)
        pcm = self._resampler.process(data)
        if self._vad is None or not pcm:
            return pcm, []
        out: list[VadEvent] = []
        td = self.turn_detection
        assert td is not None
        for v in self._vad.feed(pcm):
            if v.kind == "speech_started":
                onset = min(v.at_ms, v.audio_ms + td.prefix_padding_ms)
                out.append(
                    VadStart(onset_ms=origin_ms + onset, audio_start_ms=origin_ms + v.audio_ms)
                )
            elif v.kind == "speech_stopped":
                out.append(VadStop(audio_end_ms=origin_ms + v.audio_ms))
            elif v.kind == "pause":
                out.append(VadPause(at_ms=origin_ms + v.at_ms))
            else:
                out.append(VadResume(at_ms=origin_ms + v.at_ms))
        return pcm, out


Processed = Callable[[bytes, list[VadEvent]], None]


class InputLane:
    """Feeds one session's audio through an :class:`InputProcessor` in an executor, in order.

    ``put`` queues raw bytes (False when the backlog is full); ``configure`` swaps the
    processor after the queued audio. ``run`` is the lane's task; it delivers results with
    ``on_processed`` on the event loop.
    """

    def __init__(
        self,
        executor: Executor,
        vad_backend: Literal["silero", "energy"],
        max_backlog: int,
        on_processed: Processed,
    ) -> None:
        self._executor = executor
        self._vad_backend = vad_backend
        self._max_backlog = max_backlog
        self._on_processed = on_processed
        self._queue: deque[bytes | tuple[AudioFormat, TurnDetection | None]] = deque()
        self._backlog = 0
        self._wake = asyncio.Event()
        self._processor: InputProcessor | None = None
        self._origin_ms = 0.0  # session audio time where the current processor started
        self._fed_ms = 0.0

    @property
    def backlog(self) -> int:
        return self._backlog

    def put(self, data: bytes) -> bool:
        if self._backlog + len(data) > self._max_backlog:
            return False
        self._queue.append(data)
        self._backlog += len(data)
        self._wake.set()
        return True

    def configure(self, fmt: AudioFormat, turn_detection: TurnDetection | None) -> None:
        self._queue.append((fmt, turn_detection))
        self._wake.set()

    def _take_batch(self) -> bytes | tuple[AudioFormat, TurnDetection | None]:
        head = self._queue.popleft()
        if not isinstance(head, bytes):
            return head
        parts = [head]
        while self._queue and isinstance(self._queue[0], bytes):
            parts.append(self._queue.popleft())  # type: ignore[arg-type]
        data = b"".join(parts)
        self._backlog -= len(data)
        return data

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            item = self._take_batch()
            if not isinstance(item, bytes):
                fmt, td = item
                self._processor = await loop.run_in_executor(
                    self._executor, InputProcessor, fmt, td, self._vad_backend
                )
                self._origin_ms = self._fed_ms
                continue
            proc = self._processor
            if proc is None:
                continue  # no format configured yet: cannot interpret the bytes
            pcm, vad = await loop.run_in_executor(
                self._executor, proc.process, item, self._origin_ms
            )
            self._fed_ms += len(pcm) / 32.0
            self._on_processed(pcm, vad)
