"""A session's input, decoded and judged: wire bytes -> PCM16 16 kHz + VAD events (sync,
CPU-bound; one :class:`InputProcessor` per session, run by its input lane,
duplex_server/session/input_lane.py). Resampling is soxr's; noise suppression, when the
session asks, runs before the VAD and the ASR; the VAD is Silero (or an energy level) and
the segmenter turns its scores into speech start, pause, resume and stop; semantic_vad asks
Smart Turn at a pause (``end_of_turn: audio``) or ends a turn when the session's verdict on
the pause guess's words says so (``end_of_turn: words``, :meth:`InputProcessor.end_turn`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import numpy as np
import numpy.typing as npt

from audio_kit.denoise import NoiseReduction, NoiseSuppressor
from audio_kit.g711 import g711_to_pcm16
from audio_kit.pcm import input_resampler
from audio_kit.smart_turn import SmartTurn
from audio_kit.vad import VadEvent as AudioVadEvent
from audio_kit.vad import VadSegmenter, VadStream, VoiceActivityDetector, make_vad
from duplex_contract.audio import INPUT_RATE
from duplex_server.protocol import vad_events
from duplex_server.protocol.codec import AudioFormat
from duplex_server.protocol.events import TurnDetection
from duplex_server.protocol.vad_events import VadEvent, VadPause, VadResume, VadStart, VadStop

#: the VAD a lane runs (``engine.vad.backend``)
VadBackend = Literal["silero", "energy"]

#: VAD chunks of speech needed before speech_started (the segmenter's min_speech_ms).
MIN_SPEECH_MS = 64.0
#: an onset (one VAD window of voice) that is neither speech nor silence this long after it
#: was heard (the VAD hovering between its two thresholds) is told lost: a pause of the
#: answer on it is taken back
ONSET_HOLD_MS = 200.0
#: an onset is told (and confirm mode pauses the answer on it) only on a window of voice
#: this sure; a less sure one waits for the speech's start, one window later. (Logged once
#: inside the server on a WebRTC run of bench/turn_taking.py: the first window of a real
#: interruption scored 0.54-0.98, median ~0.8 without echo, ~0.68 over it; the echo's blips
#: that passed echo control 0.53-0.62.)
ONSET_SURE = 0.7
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
        self._resampler = input_resampler(fmt.rate, INPUT_RATE)  # (none waits)
        self._denoise = None if noise_reduction is None else NoiseSuppressor(noise_reduction)
        self._vad: VadStream | None = None
        if turn_detection is not None:
            td = turn_detection
            pause_ms = min(SPECULATE_AFTER_MS, td.silence_duration_ms / 2)
            short_pause: float | None = min(SPECULATE_SHORT_AFTER_MS, td.silence_duration_ms / 2)
            end_of_turn: Callable[[npt.NDArray[np.float32]], float | None] | None = None
            short_wait: float | None = None
            if td.type == "semantic_vad" and td.end_of_turn == "words":
                pass  # the words of the pause's guess judge it (end_turn), not the audio
            elif td.type == "semantic_vad":
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
        #: where the pause in progress began (its VadPause.at_ms; None: no pause now)
        self._pause_at: float | None = None
        #: end_turn's request: end the turn at the pause that began here, if it goes on
        self._end_at: float | None = None
        #: where the onset not yet speech was heard (the segmenter's ``candidate``; -1: it
        #: was told lost by ``ONSET_HOLD_MS``; None: no onset)
        self._onset_at: float | None = None

    def end_turn(self, pause_at_ms: float) -> None:
        """End the turn at the pause reported at ``pause_at_ms`` (its ``VadPause.at_ms``)
        when the next audio is processed, if that pause still goes on then (speech that came
        back since cancels it): the semantic end of turn of ``end_of_turn: words``."""
        self._end_at = pause_at_ms

    @property
    def holds_nothing(self) -> bool:
        """All the audio given to :meth:`prepare` has come out (the resampler holds none)."""
        return not self._resampler.holds

    def drain(self) -> tuple[bytes, list[npt.NDArray[np.float32]]]:
        """What the resampler still holds, as :meth:`prepare` gives audio (a commit of the
        input buffer takes it); the resampler then starts a new stream."""
        pcm = self._resampler.flush()
        if self._denoise is not None and pcm:
            pcm = self._denoise.process(pcm)
        if self._vad is None or not pcm:
            return pcm, []
        return pcm, self._vad.split(pcm)

    def drop_held(self) -> None:
        """Drop what the resampler holds (a clear of the input buffer)."""
        self._resampler.reset()

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
        segmenter = self._vad.segmenter
        for p, c in zip(probs, chunks, strict=True):
            found = self._vad.observe(p, c)
            self._onsets(origin_ms, out)
            self._vad_events(found, origin_ms, out)
        if self._end_at is not None:
            end_at, self._end_at = self._end_at, None
            if end_at == self._pause_at and segmenter.paused:
                stop = segmenter.end_now(self._vad.position_ms)
                if stop is not None:
                    self._pause_at = None
                    out.append(
                        VadStop(
                            audio_end_ms=origin_ms + stop.audio_ms, at_ms=origin_ms + stop.at_ms
                        )
                    )
        return out

    def _onsets(self, origin_ms: float, out: list[VadEvent]) -> None:
        """A speech onset heard (the segmenter's candidate, on a window of at least
        ``ONSET_SURE``), or lost: fallen silent before it was speech, or ``ONSET_HOLD_MS``
        of neither (between the VAD's thresholds)."""
        assert self._vad is not None
        candidate, now = self._vad.segmenter.candidate, self._vad.position_ms
        sure = self._vad.last_probability >= ONSET_SURE
        if candidate and self._onset_at is None and sure:
            self._onset_at = now
            out.append(vad_events.VadOnset(at_ms=origin_ms + now))
        elif self._onset_at is not None and not candidate:
            if not self._vad.segmenter.speaking and self._onset_at >= 0:
                out.append(vad_events.VadOnsetLost(at_ms=origin_ms + now))
            self._onset_at = None
        elif self._onset_at is not None and 0 <= self._onset_at <= now - ONSET_HOLD_MS:
            self._onset_at = -1.0  # (told lost; a speech start may still follow)
            out.append(vad_events.VadOnsetLost(at_ms=origin_ms + now))

    def _vad_events(
        self, found: list[AudioVadEvent], origin_ms: float, out: list[VadEvent]
    ) -> None:
        td = self.turn_detection
        assert td is not None
        for v in found:
            if v.kind == "speech_started":
                onset = min(v.at_ms, v.audio_ms + td.prefix_padding_ms)
                out.append(
                    VadStart(onset_ms=origin_ms + onset, audio_start_ms=origin_ms + v.audio_ms)
                )
            elif v.kind == "speech_stopped":
                self._pause_at = None
                out.append(VadStop(audio_end_ms=origin_ms + v.audio_ms, at_ms=origin_ms + v.at_ms))
            elif v.kind == "pause":
                self._pause_at = origin_ms + v.at_ms
                out.append(VadPause(at_ms=self._pause_at))
            else:
                self._pause_at = None
                out.append(VadResume(at_ms=origin_ms + v.at_ms))
