"""Voice activity detection: Silero VAD (ONNX), an RMS energy VAD, and a segmenter.

VAD is not a pipeline stage: the server runs it per session in a worker thread (never on
the event loop). Three layers:

* a detector maps one 32 ms chunk (512 float32 samples at 16 kHz) to a speech probability:
  :class:`SileroVad` (the silero-vad 6.2.3 ONNX file run by onnxruntime alone, as silero's
  own ``OnnxWrapper`` does, without torch) or :class:`EnergyVad` (RMS, no model);
* :class:`VadSegmenter`, a pure state machine that turns per-chunk probabilities into
  ``speech_started`` / ``speech_stopped`` events. Times are passed in: it reads no clock;
* :class:`VadStream` glues them for PCM16 arriving in arbitrary pieces, timing events by
  the number of samples seen.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, cast

import numpy as np
import numpy.typing as npt
import onnxruntime as ort

from audio_kit.pcm import Float32Array, pcm16_to_float32
from duplex_contract.errors import ConfigError

log = logging.getLogger(__name__)

SAMPLE_RATE = 16000
CHUNK_SAMPLES = 512  # 32 ms: the only chunk size silero's 16 kHz model accepts
_RECENT_CHUNKS = 12  # ~380 ms before speech_started: the onset and its padding
_TURN_CHUNKS = 250  # 8 s: what Smart Turn hears of a turn
_CONTEXT = 64  # samples of the previous chunk prepended to each chunk (silero v5+)
_SR = np.array(SAMPLE_RATE, dtype=np.int64)  # the model's "sr" input
CHUNK_MS = CHUNK_SAMPLES / SAMPLE_RATE * 1000.0


class VoiceActivityDetector(Protocol):
    """Speech probability of one 512-sample float32 chunk at 16 kHz; stateful per stream."""

    def probability(self, chunk: npt.NDArray[np.float32]) -> float: ...

    def reset(self) -> None: ...


def silero_vad_onnx() -> Path:
    """The silero-vad 6.2.3 ONNX file inside the installed ``silero-vad`` wheel (found
    without importing the package, which needs torch). :class:`ConfigError` if it is missing."""
    spec = importlib.util.find_spec("silero_vad")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("model package 'silero_vad' is not installed (run `make install`)")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "silero_vad.onnx"
    if not path.is_file():
        raise ConfigError(f"missing {path}")
    return path


def _check_chunk(chunk: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    if chunk.shape != (CHUNK_SAMPLES,):
        raise ValueError(f"VAD chunks are {CHUNK_SAMPLES} samples at 16 kHz, got {chunk.shape}")
    return np.asarray(chunk, dtype=np.float32)


_SESSIONS: dict[tuple[str, int], ort.InferenceSession] = {}
_SESSIONS_LOCK = threading.Lock()


def _silero_session(path: Path, threads: int) -> ort.InferenceSession:
    """One onnxruntime session per model file, shared by every stream of the process: the
    weights load once, and ``run`` is thread-safe (streams keep their own recurrent state)."""
    key = (str(path), threads)
    with _SESSIONS_LOCK:
        session = _SESSIONS.get(key)
        if session is None:
            opts = ort.SessionOptions()
            opts.intra_op_num_threads = threads
            opts.inter_op_num_threads = 1
            opts.log_severity_level = 3
            session = ort.InferenceSession(
                str(path), sess_options=opts, providers=["CPUExecutionProvider"]
            )
            _SESSIONS[key] = session
        return session


class SileroVad:
    """Silero VAD v6 on onnxruntime (1 thread). One instance per audio stream; the ONNX
    session is shared. :func:`silero_batch` runs one chunk of many streams in one call,
    through the stream's own steps: :meth:`window` (the model's input row for a chunk),
    :attr:`state` (its recurrent state) and :meth:`advance` (keep what the model returned)."""

    def __init__(self, model_path: Path | None = None, *, threads: int = 1) -> None:
        path = model_path if model_path is not None else silero_vad_onnx()
        self.session = _silero_session(path, threads)  # shared: streams batch over it
        self.state = np.zeros((2, 1, 128), dtype=np.float32)
        self._context = np.zeros((1, _CONTEXT), dtype=np.float32)

    def reset(self) -> None:
        self.state = np.zeros((2, 1, 128), dtype=np.float32)
        self._context = np.zeros((1, _CONTEXT), dtype=np.float32)

    def window(self, chunk: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        """The model's input for ``chunk``: the stream's last context samples, then it."""
        return np.concatenate([self._context, _check_chunk(chunk)[None, :]], axis=1)

    def advance(self, window: npt.NDArray[np.float32], state: npt.NDArray[np.float32]) -> None:
        """``window`` (one row) was run: keep the model's new ``state`` and its context."""
        self.state = state
        self._context = window[:, -_CONTEXT:].copy()

    def probability(self, chunk: npt.NDArray[np.float32]) -> float:
        x = self.window(chunk)
        out, state = self.session.run(None, {"input": x, "state": self.state, "sr": _SR})
        self.advance(x, np.asarray(state, dtype=np.float32))
        return float(np.asarray(out).reshape(-1)[0])


def silero_batch(items: Sequence[tuple[SileroVad, npt.NDArray[np.float32]]]) -> list[float]:
    """The next chunk of several streams in one onnxruntime call (batch = streams).

    Same result as ``vad.probability(chunk)`` for each item (the model's rows are
    independent), for a fraction of the cost: here one stream alone takes ~300 us per chunk,
    50 streams batched ~80 us each. Each stream appears at most once; all share a session.
    """
    if not items:
        return []
    if len(items) == 1:
        vad, chunk = items[0]
        return [vad.probability(chunk)]
    session = items[0][0].session
    if any(vad.session is not session for vad, _ in items):
        raise ValueError("silero_batch: streams must share one model session")
    x = np.empty((len(items), _CONTEXT + CHUNK_SAMPLES), dtype=np.float32)
    state = np.empty((2, len(items), 128), dtype=np.float32)
    for i, (vad, chunk) in enumerate(items):
        x[i] = vad.window(chunk)[0]
        state[:, i, :] = vad.state[:, 0, :]
    out, new_state = session.run(None, {"input": x, "state": state, "sr": _SR})
    new_state = np.asarray(new_state, dtype=np.float32)
    probs = np.asarray(out, dtype=np.float32).reshape(len(items), -1)[:, 0]
    for i, (vad, _) in enumerate(items):
        vad.advance(x[i : i + 1], new_state[:, i : i + 1, :].copy())
    return [float(p) for p in probs]


def probabilities(
    work: Sequence[tuple[VoiceActivityDetector, Sequence[npt.NDArray[np.float32]]]],
) -> list[list[float]]:
    """Speech probabilities of many streams' chunks, Silero streams batched per round.

    ``work`` pairs a stream's detector with its next chunks, in order; a detector may appear
    in several entries (its chunks are scored in entry order). Round ``r`` runs the ``r``-th
    chunk of every Silero stream that has one in one batched call (a stream's chunk ``r``
    needs the state left by chunk ``r - 1``); other detectors score one chunk at a time.
    """
    out: list[list[float]] = [[] for _ in work]
    streams: dict[int, list[int]] = {}  # detector -> its entries, in order
    for i, (det, chunks) in enumerate(work):
        if isinstance(det, SileroVad):
            streams.setdefault(id(det), []).append(i)
        else:
            out[i] = [det.probability(c) for c in chunks]
    groups: dict[int, list[tuple[SileroVad, list[tuple[int, npt.NDArray[np.float32]]]]]] = {}
    for entries in streams.values():
        vad = cast(SileroVad, work[entries[0]][0])
        queue = [(i, c) for i in entries for c in work[i][1]]
        groups.setdefault(id(vad.session), []).append((vad, queue))
    for members in groups.values():
        rounds = max(len(queue) for _, queue in members)
        for r in range(rounds):
            live = [(vad, queue[r]) for vad, queue in members if len(queue) > r]
            probs = silero_batch([(vad, chunk) for vad, (_, chunk) in live])
            for (_, (i, _)), p in zip(live, probs, strict=True):
                out[i].append(p)
    return out


class EnergyVad:
    """RMS level mapped linearly to [0, 1] between ``floor_db`` and ``speech_db`` (dBFS).

    No model and no state; good enough for tests and clean synthetic audio, not for a
    noisy microphone.
    """

    def __init__(self, *, floor_db: float = -50.0, speech_db: float = -30.0) -> None:
        if speech_db <= floor_db:
            raise ValueError("speech_db must be above floor_db")
        self.floor_db = floor_db
        self.speech_db = speech_db

    def reset(self) -> None:
        pass

    def probability(self, chunk: npt.NDArray[np.float32]) -> float:
        x = _check_chunk(chunk)
        rms = math.sqrt(float(np.dot(x, x)) / CHUNK_SAMPLES)  # one BLAS call, not three
        db = 20.0 * math.log10(max(rms, 1e-9))
        p = (db - self.floor_db) / (self.speech_db - self.floor_db)
        return min(1.0, max(0.0, p))


def make_vad(backend: Literal["silero", "energy"]) -> VoiceActivityDetector:
    """The detector named by ``engine.vad.backend``."""
    if backend == "silero":
        return SileroVad()
    return EnergyVad()


@dataclass(frozen=True, slots=True)
class VadEvent:
    """``audio_ms``: where speech starts (minus prefix padding, clamped at 0) or where it
    stopped, on the stream's audio timeline. ``at_ms``: the audio time at which the decision
    was made. ``onset_ms``: where speech really started (no padding); for a stop, where the
    silence began (= ``audio_ms``)."""

    kind: Literal["speech_started", "speech_stopped", "pause", "resume"]
    audio_ms: float
    at_ms: float
    onset_ms: float


class VadSegmenter:
    """Per-chunk probabilities -> speech start/stop events (pure; no clock, no I/O).

    Hysteresis as in silero's ``get_speech_timestamps``: a chunk at or above ``threshold`` is
    speech, one below ``threshold - 0.15`` is silence, one in between keeps the current state.
    Speech starts once ``min_speech_ms`` of speech has accumulated since the candidate onset
    (its ``audio_ms`` is the onset minus ``prefix_padding_ms``); it stops after
    ``silence_duration_ms`` of silence (``audio_ms`` = where the silence began).

    With ``pause_ms`` set, a ``pause`` event fires once ``pause_ms`` of silence has passed
    inside speech (the server then starts ASR speculatively), and a ``resume`` event if speech
    returns before the stop (the speculation is dropped). With ``short_pause_ms`` too, a
    pause comes after that much silence instead while the speech so far (onset -> silence)
    is under ``short_turn_ms``: a guess of a short turn is cheap, so it may start sooner.
    """

    def __init__(
        self,
        *,
        threshold: float = 0.5,
        min_speech_ms: float = 64.0,
        silence_duration_ms: float = 320.0,
        prefix_padding_ms: float = 300.0,
        pause_ms: float | None = None,
        short_pause_ms: float | None = None,
        short_turn_ms: float = 3000.0,
    ) -> None:
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"threshold must be in (0, 1], got {threshold}")
        self.threshold = threshold
        self.neg_threshold = max(threshold - 0.15, 0.01)
        self.min_speech_ms = min_speech_ms
        self.silence_duration_ms = silence_duration_ms
        self.prefix_padding_ms = prefix_padding_ms
        self.pause_ms = pause_ms
        self.short_pause_ms = short_pause_ms
        self.short_turn_ms = short_turn_ms
        #: this silence ends the turn after this long instead of ``silence_duration_ms``
        #: (set at a pause by a semantic verdict; cleared when speech returns or stops)
        self.stop_after_ms: float | None = None
        self.paused = False
        self.speaking = False
        self._onset: float | None = None
        self._silence: float | None = None

    def reset(self) -> None:
        self.stop_after_ms = None
        self.paused = False
        self.speaking = False
        self._onset = None
        self._silence = None

    @property
    def candidate(self) -> bool:
        """Is a speech onset heard (a chunk at or above ``threshold``) that has not yet
        lasted ``min_speech_ms`` (or been dropped by a chunk of silence)?"""
        return not self.speaking and self._onset is not None

    def update(self, probability: float, start_ms: float, end_ms: float) -> VadEvent | None:
        """Feed one chunk covering [start_ms, end_ms) of the audio timeline."""
        is_speech = probability >= self.threshold
        is_silence = probability < self.neg_threshold
        if not self.speaking:
            if is_speech:
                if self._onset is None:
                    self._onset = start_ms
                if end_ms - self._onset >= self.min_speech_ms:
                    self.speaking = True
                    self._silence = None
                    begin = max(0.0, self._onset - self.prefix_padding_ms)
                    return VadEvent("speech_started", begin, end_ms, self._onset)
            elif is_silence:
                self._onset = None
            return None
        if is_speech:
            self._silence = None
            self.stop_after_ms = None
            if self.paused:
                self.paused = False
                return VadEvent("resume", start_ms, end_ms, start_ms)
        elif is_silence:
            if self._silence is None:
                self._silence = start_ms
            limit = self.stop_after_ms
            if end_ms - self._silence >= (self.silence_duration_ms if limit is None else limit):
                return self._stop(self._silence, end_ms)
            if (
                self.pause_ms is not None
                and not self.paused
                and end_ms - self._silence >= self._pause_after()
            ):
                self.paused = True
                return VadEvent("pause", self._silence, end_ms, self._silence)
        return None

    def _pause_after(self) -> float:
        """The silence (ms) after which the pause in progress fires."""
        assert self.pause_ms is not None and self._silence is not None
        short = self.short_pause_ms
        if short is not None and self._onset is not None:
            if self._silence - self._onset < self.short_turn_ms:
                return min(short, self.pause_ms)
        return self.pause_ms

    def end_now(self, at_ms: float) -> VadEvent | None:
        """End the speech in progress now (a semantic end of turn during a pause); the
        stop's ``audio_ms`` is where the silence began."""
        if not self.speaking:
            return None
        return self._stop(self._silence if self._silence is not None else at_ms, at_ms)

    def finish(self, end_ms: float) -> VadEvent | None:
        """End of input: close an open speech segment."""
        if not self.speaking:
            self._onset = None
            return None
        return self._stop(self._silence if self._silence is not None else end_ms, end_ms)

    def _stop(self, audio_ms: float, at_ms: float) -> VadEvent:
        self.stop_after_ms = None
        self.paused = False
        self.speaking = False
        self._onset = None
        self._silence = None
        return VadEvent("speech_stopped", audio_ms, at_ms, audio_ms)


class VadStream:
    """A detector and a segmenter over PCM16 16 kHz audio arriving in arbitrary pieces.

    Sync and CPU-bound: call it from a worker thread. Times are the stream's audio time
    (samples fed / 16 kHz), starting at 0 or at ``reset(start_ms)``.
    """

    def __init__(
        self,
        detector: VoiceActivityDetector,
        segmenter: VadSegmenter,
        end_of_turn: Callable[[Float32Array], float | None] | None = None,
        min_turn_ms: float = 0.0,
        short_turn_wait_ms: float | None = None,
    ) -> None:
        """``end_of_turn``: asked at each ``pause`` of a turn with at least ``min_turn_ms``
        of speech (onset -> silence), with the turn's audio so far (16 kHz, from ~380 ms
        before speech_started, at most the last 8 s); it returns the silence (ms) after
        which this pause ends the turn: at most the silence so far ends it there
        (``speech_stopped`` right after the ``pause``), None keeps the segmenter's
        ``silence_duration_ms``. A shorter turn's pause waits ``short_turn_wait_ms``."""
        self.min_turn_ms = min_turn_ms
        self.short_turn_wait_ms = short_turn_wait_ms
        self._turn_onset = 0.0
        self.detector = detector
        self.segmenter = segmenter
        self.end_of_turn = end_of_turn
        self._recent: deque[Float32Array] = deque(maxlen=_RECENT_CHUNKS)
        self._turn: deque[Float32Array] = deque(maxlen=_TURN_CHUNKS)
        self._pending = np.zeros(0, dtype=np.float32)
        self._carry = b""
        self._samples = 0
        self._origin_ms = 0.0
        self.last_probability = 0.0

    @property
    def position_ms(self) -> float:
        return self._origin_ms + self._samples / SAMPLE_RATE * 1000.0

    def feed(self, pcm: bytes) -> list[VadEvent]:
        events: list[VadEvent] = []
        for chunk in self.split(pcm):
            events += self.observe(self.detector.probability(chunk), chunk)
        return events

    def split(self, pcm: bytes) -> list[npt.NDArray[np.float32]]:
        """Buffer ``pcm``; return the whole 512-sample chunks now ready, in order. Each must
        then be scored and passed to :meth:`observe`, in order (``feed`` does both; the
        server scores many streams' chunks in one batch with :func:`probabilities`)."""
        data = self._carry + pcm if self._carry else pcm
        cut = len(data) - len(data) % 2
        self._carry = data[cut:]
        return self._chunks(pcm16_to_float32(data[:cut] if self._carry else data))

    def split_samples(self, samples: Float32Array) -> list[npt.NDArray[np.float32]]:
        """:meth:`split` for audio already in float32 (``pcm16_to_float32`` of the PCM16,
        whole samples only: not to be mixed with :meth:`split` of an odd byte count)."""
        if self._carry:
            raise ValueError("split_samples after split left half a sample")
        return self._chunks(samples)

    def _chunks(self, samples: Float32Array) -> list[npt.NDArray[np.float32]]:
        audio = np.concatenate([self._pending, samples]) if self._pending.size else samples
        n_chunks = len(audio) // CHUNK_SAMPLES
        chunks = [audio[i * CHUNK_SAMPLES : (i + 1) * CHUNK_SAMPLES] for i in range(n_chunks)]
        self._pending = audio[n_chunks * CHUNK_SAMPLES :].copy()
        return chunks

    def observe(self, probability: float, chunk: Float32Array) -> list[VadEvent]:
        """The next chunk and its speech probability: advance the clock, update the
        segmenter, and (with ``end_of_turn``) keep the turn's audio and ask at a pause."""
        start = self.position_ms
        self._samples += CHUNK_SAMPLES
        self.last_probability = probability
        event = self.segmenter.update(probability, start, self.position_ms)
        if self.end_of_turn is not None:
            self._recent.append(chunk)
            if event is not None and event.kind == "speech_started":
                self._turn = deque(self._recent, maxlen=_TURN_CHUNKS)
                self._turn_onset = event.onset_ms
            elif self.segmenter.speaking:
                self._turn.append(chunk)
        if event is None:
            return []
        events = [event]
        if event.kind == "pause" and self.end_of_turn is not None:
            if event.audio_ms - self._turn_onset >= self.min_turn_ms:
                wait = self.end_of_turn(np.concatenate(list(self._turn)))
            else:
                wait = self.short_turn_wait_ms
            if wait is not None and wait <= event.at_ms - event.audio_ms:
                stop = self.segmenter.end_now(self.position_ms)
                if stop is not None:
                    events.append(stop)
            else:
                self.segmenter.stop_after_ms = wait
        return events

    def finish(self) -> VadEvent | None:
        return self.segmenter.finish(self.position_ms)

    def reset(self, start_ms: float = 0.0) -> None:
        self.detector.reset()
        self.segmenter.reset()
        self._pending = np.zeros(0, dtype=np.float32)
        self._carry = b""
        self._samples = 0
        self._origin_ms = start_ms
        self.last_probability = 0.0
        self._recent.clear()
        self._turn.clear()
