"""The input lane of a session: decode the wire format, resample to 16 kHz (soxr), suppress
noise if the session asks (``audio.input.noise_reduction``, audio_kit/denoise.py; before the VAD
and the ASR, which both see the cleaned audio), run the VAD, all in a worker thread (never
on the event loop), in order per session; the lanes of all sessions share one scheduler that
batches them into few executor jobs.

The lane turns raw client audio into ``(pcm16 16 kHz, [VadStart | VadStop])`` for the
protocol core, which owns the barge-in policy (minimum speech before interrupting, the
uninterruptible window at the start of a response: see ``protocol/input.py``).

Back-pressure: the lane holds at most ``max_backlog`` bytes of unprocessed audio; an append
beyond that is refused with ``input_backpressure`` and dropped (the client is told).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from audio_kit.denoise import NoiseReduction
from audio_kit.vad import VoiceActivityDetector, probabilities
from duplex_contract.audio import input_ms
from duplex_server.protocol.codec import AudioFormat
from duplex_server.protocol.events import TurnDetection
from duplex_server.protocol.vad_events import VadEvent
from duplex_server.session.input_processor import InputProcessor, VadBackend

log = logging.getLogger(__name__)


@dataclass(slots=True)
class LaneStep:
    """One prepared piece of a lane's audio, between the two halves of a job (``processor``
    None: a :class:`Barrier` reached, in order)."""

    processor: InputProcessor | None
    origin_ms: float
    pcm: bytes
    chunks: list[npt.NDArray[np.float32]]

    @property
    def detector(self) -> VoiceActivityDetector | None:
        return self.processor.detector if self.chunks and self.processor else None


Processed = Callable[[bytes, list[VadEvent]], None]
Failed = Callable[[BaseException], None]
#: a new configuration for the lane's processor (queued in order with the audio)
LaneConfig = tuple[AudioFormat, TurnDetection | None, NoiseReduction | None]


@dataclass(frozen=True, slots=True)
class EndTurn:
    """A lane item: end the turn at the pause that began at ``pause_at_ms``
    (:meth:`InputProcessor.end_turn`), in order with the audio."""

    pause_at_ms: float


@dataclass(frozen=True, slots=True)
class Barrier:
    """A lane item: the session goes on (``on_barrier``) once the audio queued before it is
    processed: a commit or a clear of the input buffer then covers all the audio sent before
    it. ``flush``: what the resampler still holds of that audio comes out first (a commit);
    otherwise it is dropped (a clear)."""

    flush: bool


#: what a lane queues: raw audio, a configuration, an end of turn or a barrier
LaneItem = bytes | LaneConfig | EndTurn | Barrier
#: a job's outcome for one lane: (pcm16 16 kHz, VAD events) per audio piece (None: a
#: barrier reached), or its error
LaneResult = list[tuple[bytes, list[VadEvent]] | None] | BaseException


def _ignore(*_: object) -> None:
    """A closed lane's callbacks."""


class InputLane:
    """One session's input audio, processed by an :class:`InputProcessor` off the loop, in order.

    ``put`` queues raw bytes (False when the backlog is full); ``configure`` swaps the
    processor after the queued audio. The lane has no task of its own: the hub's
    :class:`InputScheduler` processes every lane with queued work in one worker-thread job
    (one executor hop per batch of lanes, not per chunk) and delivers the results on the event
    loop with ``on_processed``, in order. A lane is never in two jobs at once.
    """

    def __init__(
        self,
        scheduler: InputScheduler,
        vad_backend: VadBackend,
        max_backlog: int,
        on_processed: Processed,
        on_failed: Failed,
        on_barrier: Callable[[], None] | None = None,
    ) -> None:
        self._scheduler = scheduler
        self._vad_backend = vad_backend
        #: the energy VAD is an RMS level (no model): it and the resampling (a few us per
        #: chunk) run on the loop, cheaper than any thread hop. Silero runs in worker threads.
        self.inline = vad_backend == "energy"
        self._max_backlog = max_backlog
        self._on_processed = on_processed
        self._on_failed = on_failed
        self._on_barrier: Callable[[], None] = on_barrier or _ignore
        self._queue: deque[LaneItem] = deque()
        self._backlog = 0
        self._busy = False  # in a worker job now
        self._closed = False
        self._processor: InputProcessor | None = None  # touched only by the job that owns it
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
        if not self._busy:
            self._scheduler.ready(self)
        return True

    def configure(
        self,
        fmt: AudioFormat,
        turn_detection: TurnDetection | None,
        noise_reduction: NoiseReduction | None = None,
    ) -> None:
        self._queue.append((fmt, turn_detection, noise_reduction))
        if not self._busy:
            self._scheduler.ready(self)

    @property
    def settled(self) -> bool:
        """Nothing queued or in a job, and the resampler holds nothing back: all the audio
        put so far has been handed to the session."""
        if self._busy or self._queue:
            return False
        proc = self._processor
        return proc is None or proc.holds_nothing

    def barrier(self, flush: bool) -> None:
        """Call ``on_barrier`` once the audio queued now has been processed (``flush``: and
        what the resampler holds of it has come out; else that is dropped)."""
        self._queue.append(Barrier(flush))
        if not self._busy:
            self._scheduler.ready(self)

    def end_turn(self, pause_at_ms: float) -> None:
        """End the turn at the pause that began at ``pause_at_ms``, if it still goes on when
        the next audio is processed (queued in order with the audio)."""
        self._queue.append(EndTurn(pause_at_ms))

    def close(self) -> None:
        """The session ended: drop queued audio; a job in flight delivers nothing."""
        self._closed = True
        self._queue.clear()
        self._backlog = 0
        # the callbacks are the session's bound methods (session -> lane -> session): drop
        # them, so that an ended session is freed at once, not by the cyclic GC
        self._on_processed, self._on_failed, self._on_barrier = _ignore, _ignore, _ignore

    # ------------------------------------------------------------------ scheduler side
    @property
    def runnable(self) -> bool:
        """Work is queued and the lane is neither in a job nor closed."""
        return not self._busy and not self._closed and bool(self._queue)

    def take(self) -> list[LaneItem]:
        """Start a job (the lane is busy until :meth:`deliver`): everything queued,
        consecutive audio joined (called on the loop)."""
        self._busy = True
        items: list[LaneItem] = []
        parts: list[bytes] = []
        for item in self._queue:
            if isinstance(item, bytes):
                parts.append(item)
                continue
            if parts:
                items.append(b"".join(parts))
                parts = []
            items.append(item)
        if parts:
            items.append(parts[0] if len(parts) == 1 else b"".join(parts))
        self._queue.clear()
        self._backlog = 0
        return items

    def work(self, items: list[LaneItem]) -> LaneResult:
        """Worker thread: configure and process ``items`` in order (this lane alone)."""
        staged = self.stage(items)
        if isinstance(staged, BaseException):
            return staged
        try:
            scores = probabilities([(d, step.chunks) for step in staged if (d := step.detector)])
        except Exception as exc:
            return exc
        return finish_steps(staged, scores)

    def stage(self, items: list[LaneItem]) -> list[LaneStep] | BaseException:
        """Worker thread, first half: configure, decode, resample and cut VAD chunks."""
        steps: list[LaneStep] = []
        try:
            for item in items:
                if isinstance(item, EndTurn):
                    if self._processor is not None:
                        self._processor.end_turn(item.pause_at_ms)
                    continue
                if isinstance(item, Barrier):
                    proc = self._processor
                    if proc is not None and item.flush:
                        pcm, chunks = proc.drain()
                        if pcm:
                            steps.append(LaneStep(proc, self._origin_ms, pcm, chunks))
                            self._fed_ms += input_ms(len(pcm))
                    elif proc is not None:
                        proc.drop_held()
                    steps.append(LaneStep(None, 0.0, b"", []))
                    continue
                if not isinstance(item, bytes):
                    self._processor = InputProcessor(item[0], item[1], self._vad_backend, item[2])
                    self._origin_ms = self._fed_ms
                    continue
                proc = self._processor
                if proc is None:
                    continue  # no format configured yet: cannot interpret the bytes
                pcm, chunks = proc.prepare(item)
                steps.append(LaneStep(proc, self._origin_ms, pcm, chunks))
                self._fed_ms += input_ms(len(pcm))
        except Exception as exc:  # reported to this lane's session only
            return exc
        return steps

    def deliver(self, result: LaneResult) -> None:
        """Event loop: hand the job's results to the session, in order."""
        self._busy = False
        if self._closed:
            return
        if isinstance(result, BaseException):
            self._closed = True
            self._queue.clear()
            self._on_failed(result)
            return
        for piece in result:
            if piece is None:  # a barrier: the session goes on
                self._on_barrier()
                if self._closed:
                    return
                continue
            pcm, vad = piece
            if pcm or vad:  # (soxr gives nothing for some pieces: its output comes in blocks)
                self._on_processed(pcm, vad)
        if self._queue and not self._closed:
            self._scheduler.ready(self)


def finish_steps(steps: list[LaneStep], scores: list[list[float]]) -> LaneResult:
    """Worker thread, second half: the scored chunks -> VAD events, in order. ``scores``
    holds one list per step that has a detector, in step order."""
    out: list[tuple[bytes, list[VadEvent]] | None] = []
    it = iter(scores)
    try:
        for step in steps:
            if step.processor is None:
                out.append(None)
                continue
            probs = next(it) if step.detector is not None else []
            events = step.processor.events(probs, step.chunks, step.origin_ms)
            out.append((step.pcm, events))
    except Exception as exc:
        return exc
    return out


def _deliver(lane: InputLane, result: LaneResult) -> None:
    try:
        lane.deliver(result)
    except Exception:  # one session's failure never stops the others' delivery
        log.exception("input delivery failed")


def run_jobs(jobs: list[tuple[InputLane, list[LaneItem]]]) -> list[LaneResult]:
    """One worker-thread job for many lanes: their Silero chunks are scored together
    (:func:`probabilities`: one onnxruntime call per round for all streams) instead of one
    call per chunk per session."""
    staged = [lane.stage(items) for lane, items in jobs]
    work: list[tuple[VoiceActivityDetector, list[npt.NDArray[np.float32]]]] = []
    for st in staged:
        if not isinstance(st, BaseException):
            work += [(d, step.chunks) for step in st if (d := step.detector) is not None]
    try:
        scores = probabilities(work)
    except Exception:  # one bad stream must not fail the others: score each lane alone
        log.exception("batched VAD failed; scoring each session alone")
        return [
            lane.work(items) if not isinstance(st, BaseException) else st
            for (lane, items), st in zip(jobs, staged, strict=True)
        ]
    results: list[LaneResult] = []
    pos = 0
    for st in staged:
        if isinstance(st, BaseException):
            results.append(st)
            continue
        n = sum(1 for step in st if step.detector is not None)
        results.append(finish_steps(st, scores[pos : pos + n]))
        pos += n
    return results


class InputScheduler:
    """Runs the queued input of all lanes in worker threads, batched.

    Lanes that get work in one event-loop iteration are collected (``call_soon``) and handed
    to the executor as one job; at most ``max_jobs`` jobs run at once, and lanes that get more
    audio meanwhile wait for the next job. Under load the batches grow instead of the number
    of thread hops.
    """

    def __init__(self, executor: Executor, max_jobs: int) -> None:
        self._executor = executor
        self._max_jobs = max(1, max_jobs)
        self._ready: dict[InputLane, None] = {}  # insertion-ordered set
        self._running = 0
        self._scheduled = False
        self._loop: asyncio.AbstractEventLoop | None = None

    def ready(self, lane: InputLane) -> None:
        self._ready[lane] = None
        if not self._scheduled and (lane.inline or self._running < self._max_jobs):
            self._scheduled = True
            if self._loop is None:
                self._loop = asyncio.get_running_loop()
            self._loop.call_soon(self._kick)

    def _kick(self) -> None:
        self._scheduled = False
        if not self._ready:
            return
        lanes = list(self._ready)
        self._ready.clear()
        jobs: list[tuple[InputLane, list[LaneItem]]] = []
        full = self._running >= self._max_jobs
        for lane in lanes:
            if not lane.runnable:
                continue
            if lane.inline:
                _deliver(lane, lane.work(lane.take()))
            elif full:
                self._ready[lane] = None  # the next free job takes it
            else:
                jobs.append((lane, lane.take()))
        if not jobs:
            return
        self._running += 1
        loop = self._loop
        assert loop is not None
        fut = loop.run_in_executor(self._executor, run_jobs, jobs)
        fut.add_done_callback(lambda f: self._done(jobs, f))

    def _done(
        self,
        jobs: list[tuple[InputLane, list[LaneItem]]],
        fut: asyncio.Future[list[LaneResult]],
    ) -> None:
        self._running -= 1
        if fut.cancelled():
            results: list[LaneResult] = [RuntimeError("input job cancelled")] * len(jobs)
        elif (exc := fut.exception()) is not None:
            results = [exc] * len(jobs)
        else:
            results = fut.result()
        for (lane, _), result in zip(jobs, results, strict=True):
            _deliver(lane, result)
        if self._ready and not self._scheduled:
            self._scheduled = True
            assert self._loop is not None
            self._loop.call_soon(self._kick)
