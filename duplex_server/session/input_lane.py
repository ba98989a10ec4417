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
from typing import Literal

import numpy as np
import numpy.typing as npt

from audio_kit.denoise import NoiseReduction, NoiseSuppressor
from audio_kit.g711 import g711_to_pcm16
from audio_kit.pcm import StreamResampler
from audio_kit.smart_turn import SmartTurn
from audio_kit.vad import VadSegmenter, VadStream, VoiceActivityDetector, make_vad, probabilities
from duplex_contract.audio import INPUT_RATE, input_ms
from duplex_server.protocol.codec import AudioFormat
from duplex_server.protocol.events import TurnDetection
from duplex_server.protocol.vad_events import VadEvent, VadPause, VadResume, VadStart, VadStop

log = logging.getLogger(__name__)

#: the VAD a lane runs (``engine.vad.backend``)
VadBackend = Literal["silero", "energy"]

#: VAD chunks of speech needed before speech_started (the segmenter's min_speech_ms).
MIN_SPEECH_MS = 64.0
#: Silence inside speech after which the engine transcribes speculatively (``input.pause``),
#: so the transcript is ready when silence_duration_ms later ends the turn. Capped at half the
#: silence window. Speech that resumes drops the speculation (``input.resume``).
SPECULATE_AFTER_MS = 96.0
#: ... and after this much while the turn has less than SPECULATE_SHORT_TURN_MS of speech: a
#: short turn's guess is cheap (Whisper's cost grows with the audio), so a guess made stale
#: by speech that resumes costs little, and a short question's answer starts 32 ms sooner.
#: A long turn keeps SPECULATE_AFTER_MS: its guesses cost ~0.3-0.4 s each, and one started
#: at a brief dip late in a long sentence held the ASR when the real pause came.
SPECULATE_SHORT_AFTER_MS = 64.0
SPECULATE_SHORT_TURN_MS = 3000.0
#: semantic_vad: silence after which Smart Turn judges how finished the turn sounds. At or
#: above the eagerness's threshold the turn ends there; below SEMANTIC_UNFINISHED (it sounds
#: unfinished) it waits silence_duration_ms (the eagerness's longest wait); in between, the
#: ordinary SEMANTIC_PLAIN_WAIT_MS (server_vad's default window).
SEMANTIC_CHECK_MS = 200.0
SEMANTIC_THRESHOLD = {"low": 0.98, "medium": 0.8, "auto": 0.8, "high": 0.6}
SEMANTIC_UNFINISHED = 0.1
SEMANTIC_PLAIN_WAIT_MS = 500.0
#: semantic_vad: a turn with less speech than this is not judged (Smart Turn calls a lone
#: "it" complete); it waits SEMANTIC_PLAIN_WAIT_MS
SEMANTIC_MIN_SPEECH_MS = 400.0


def _turn_wait(
    threshold: float, plain_ms: float
) -> Callable[[npt.NDArray[np.float32]], float | None]:
    """Smart Turn's verdict on a turn so far, as the silence (ms) that ends it: 0 (now),
    ``plain_ms``, or None (the longest wait). The model is loaded once a process."""
    model = SmartTurn.shared()

    def judge(audio: npt.NDArray[np.float32]) -> float | None:
        p = model.probability(audio)
        if p >= threshold:
            return 0.0
        return plain_ms if p >= SEMANTIC_UNFINISHED else None

    return judge


class InputProcessor:
    """Sync and CPU-bound: wire bytes -> PCM16 16 kHz + VAD events. One per session."""

    def __init__(
        self,
        fmt: AudioFormat,
        turn_detection: TurnDetection | None,
        vad_backend: VadBackend,
        noise_reduction: NoiseReduction | None = None,
    ) -> None:
        self.format = fmt
        self.turn_detection = turn_detection
        self._resampler = StreamResampler(fmt.rate, INPUT_RATE)
        self._denoise = None if noise_reduction is None else NoiseSuppressor(noise_reduction)
        self._vad: VadStream | None = None
        if turn_detection is not None:
            td = turn_detection
            pause_ms = min(SPECULATE_AFTER_MS, td.silence_duration_ms / 2)
            short_pause: float | None = min(SPECULATE_SHORT_AFTER_MS, td.silence_duration_ms / 2)
            end_of_turn: Callable[[npt.NDArray[np.float32]], float | None] | None = None
            short_wait: float | None = None
            if td.type == "semantic_vad":
                pause_ms = min(SEMANTIC_CHECK_MS, td.silence_duration_ms / 2)
                short_pause = None
                short_wait = min(SEMANTIC_PLAIN_WAIT_MS, float(td.silence_duration_ms))
                end_of_turn = _turn_wait(SEMANTIC_THRESHOLD[td.eagerness or "auto"], short_wait)
            segmenter = VadSegmenter(
                threshold=max(td.threshold, 0.01),
                min_speech_ms=MIN_SPEECH_MS,
                silence_duration_ms=float(td.silence_duration_ms),
                prefix_padding_ms=float(td.prefix_padding_ms),
                pause_ms=pause_ms,
                short_pause_ms=short_pause,
                short_turn_ms=SPECULATE_SHORT_TURN_MS,
            )
            self._vad = VadStream(
                make_vad(vad_backend), segmenter, end_of_turn, SEMANTIC_MIN_SPEECH_MS, short_wait
            )

    def process(self, data: bytes, origin_ms: float) -> tuple[bytes, list[VadEvent]]:
        """Decode and resample ``data``; VAD times are offset by ``origin_ms``."""
        pcm, chunks = self.prepare(data)
        if self._vad is None:
            return pcm, []
        detector = self._vad.detector
        probs = [detector.probability(c) for c in chunks]
        return pcm, self.events(probs, chunks, origin_ms)

    @property
    def detector(self) -> VoiceActivityDetector | None:
        return None if self._vad is None else self._vad.detector

    def prepare(self, data: bytes) -> tuple[bytes, list[npt.NDArray[np.float32]]]:
        """Decode and resample ``data``: the PCM16 16 kHz audio and the VAD chunks it
        completes, to be scored (possibly batched with other sessions') and passed to
        :meth:`events` in order."""
        if self.format.codec != "pcm16":
            data = g711_to_pcm16(data, self.format.codec)
        if self._vad is None or self._denoise is not None:
            pcm = self._resampler.process(data)
            if self._denoise is not None:
                pcm = self._denoise.process(pcm)
            if self._vad is None or not pcm:
                return pcm, []
            return pcm, self._vad.split(pcm)
        # the resampler's float32 output goes to the VAD as is (the same samples as the
        # PCM16, without converting them back: this runs every 20 ms of every session)
        pcm, samples = self._resampler.process_samples(data)
        if not pcm:
            return pcm, []
        return pcm, self._vad.split_samples(samples)

    def events(
        self, probs: list[float], chunks: list[npt.NDArray[np.float32]], origin_ms: float
    ) -> list[VadEvent]:
        """The VAD events of the prepared chunks and their probabilities, offset by
        ``origin_ms``."""
        if self._vad is None:
            return []
        out: list[VadEvent] = []
        td = self.turn_detection
        assert td is not None
        found = [v for p, c in zip(probs, chunks, strict=True) for v in self._vad.observe(p, c)]
        for v in found:
            if v.kind == "speech_started":
                onset = min(v.at_ms, v.audio_ms + td.prefix_padding_ms)
                out.append(
                    VadStart(onset_ms=origin_ms + onset, audio_start_ms=origin_ms + v.audio_ms)
                )
            elif v.kind == "speech_stopped":
                out.append(VadStop(audio_end_ms=origin_ms + v.audio_ms, at_ms=origin_ms + v.at_ms))
            elif v.kind == "pause":
                out.append(VadPause(at_ms=origin_ms + v.at_ms))
            else:
                out.append(VadResume(at_ms=origin_ms + v.at_ms))
        return out


@dataclass(slots=True)
class LaneStep:
    """One prepared piece of a lane's audio, between the two halves of a job."""

    processor: InputProcessor
    origin_ms: float
    pcm: bytes
    chunks: list[npt.NDArray[np.float32]]

    @property
    def detector(self) -> VoiceActivityDetector | None:
        return self.processor.detector if self.chunks else None


Processed = Callable[[bytes, list[VadEvent]], None]
Failed = Callable[[BaseException], None]
#: a new configuration for the lane's processor (queued in order with the audio)
LaneConfig = tuple[AudioFormat, TurnDetection | None, NoiseReduction | None]
#: what a lane queues: raw audio or a configuration
LaneItem = bytes | LaneConfig
#: a job's outcome for one lane: (pcm16 16 kHz, VAD events) per audio piece, or its error
LaneResult = list[tuple[bytes, list[VadEvent]]] | BaseException


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
    ) -> None:
        self._scheduler = scheduler
        self._vad_backend = vad_backend
        #: the energy VAD is an RMS level (no model): it and the resampling (a few us per
        #: chunk) run on the loop, cheaper than any thread hop. Silero runs in worker threads.
        self.inline = vad_backend == "energy"
        self._max_backlog = max_backlog
        self._on_processed = on_processed
        self._on_failed = on_failed
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

    def close(self) -> None:
        """The session ended: drop queued audio; a job in flight delivers nothing."""
        self._closed = True
        self._queue.clear()
        self._backlog = 0
        # the callbacks are the session's bound methods (session -> lane -> session): drop
        # them, so that an ended session is freed at once, not by the cyclic GC
        self._on_processed, self._on_failed = _ignore, _ignore

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
        for pcm, vad in result:
            self._on_processed(pcm, vad)
        if self._queue and not self._closed:
            self._scheduler.ready(self)


def finish_steps(steps: list[LaneStep], scores: list[list[float]]) -> LaneResult:
    """Worker thread, second half: the scored chunks -> VAD events, in order. ``scores``
    holds one list per step that has a detector, in step order."""
    out: list[tuple[bytes, list[VadEvent]]] = []
    it = iter(scores)
    try:
        for step in steps:
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
