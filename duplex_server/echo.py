"""Echo control for media transports: the server's own output cancelled from the input.

A caller on a phone or a speakerphone sends back what the bot said. :class:`EchoControl`
runs the WebRTC audio-processing module's echo canceller (through ``livekit.rtc``'s
``AudioProcessingModule``, a maintained wheel of the WebRTC APM) with the server's own
output as the far-end reference, at 16 kHz in 10 ms frames, plus a barge-in guard.

Alignment: the transport tells :meth:`EchoControl.playing` what it plays, in order, and the
reference for each 10 ms of microphone input is the next 10 ms of that playout, so the
reference advances at the microphone's pace (both are real-time clocks on the far end).
Twilio reports what was played with ``mark`` echoes (:meth:`EchoControl.played_through`
skips the reference ahead if it lags); WebRTC hands over what its track sends as it sends
it. The canceller's own delay estimator absorbs the rest (the echo path, 120 ms in the test).

Barge-in guard: while the reference is loud (the bot speaks), a frame whose level after
cancellation stays below ``GUARD_RATIO`` of the reference's recent level is echo-level and
reaches VAD as silence; speech louder than that passes and can interrupt.
"""

from __future__ import annotations

from collections import deque

import numpy as np

RATE = 16000
FRAME = RATE // 100  # 10 ms, what the APM processes
_FRAME_BYTES = FRAME * 2
#: reference RMS (int16) above which the bot counts as speaking
SPEAKING_RMS = 200.0
#: near-end RMS needed while the bot speaks, as a fraction of the reference's recent RMS
GUARD_RATIO = 0.2
#: how far back the guard looks at the reference (echo path + jitter)
GUARD_WINDOW_FRAMES = 40  # 400 ms
#: how far the reference may lag what the far end reports as played before it skips ahead
RESYNC_SAMPLES = RATE // 4  # 250 ms
#: playout not yet heard kept at most (Twilio buffers a whole reply ahead)
MAX_REFERENCE_S = 60.0


def _rms(frame: np.ndarray) -> float:
    return float(np.sqrt(np.mean(frame.astype(np.float64) ** 2))) if frame.size else 0.0


class EchoControl:
    """One per session with echo control on. PCM16 mono at 16 kHz in and out."""

    def __init__(self) -> None:
        from livekit import rtc  # imported here: only sessions with echo control load it

        self._rtc = rtc
        self._apm = rtc.AudioProcessingModule(echo_cancellation=True, high_pass_filter=True)
        self._ref = bytearray()  # playout not yet matched with microphone input
        self._ref_pos = 0  # samples of playout consumed so far (matched with input)
        self._ref_total = 0  # samples of playout queued so far
        self._mic = b""  # an incomplete 10 ms frame
        self._levels: deque[float] = deque(maxlen=GUARD_WINDOW_FRAMES)
        self.guarded_frames = 0  # frames the guard silenced (for tests and metrics)

    # ------------------------------------------------------------------ far end
    def playing(self, pcm16k: bytes) -> int:
        """Queue what the transport plays (or will play next); returns its end position
        in samples since the start of the session's playout."""
        self._ref += pcm16k
        self._ref_total += len(pcm16k) // 2
        excess = len(self._ref) - int(MAX_REFERENCE_S * RATE) * 2
        if excess > 0:
            self._skip(excess // 2)
        return self._ref_total

    def played_through(self, position: int) -> None:
        """The transport says playout reached ``position`` (samples): catch up if far behind.

        The microphone input that carries the echo of that playout is still on its way
        (a mark and the next media frame leave the far end together), so a lag under
        ``RESYNC_SAMPLES`` is normal and kept.
        """
        if position - self._ref_pos > RESYNC_SAMPLES:
            self._skip(position - self._ref_pos)

    def flush(self) -> None:
        """The transport dropped what it had not played (barge-in: Twilio clear)."""
        self._skip(len(self._ref) // 2)

    def _skip(self, samples: int) -> None:
        n = min(samples, len(self._ref) // 2)
        del self._ref[: n * 2]
        self._ref_pos += n

    # ------------------------------------------------------------------ near end
    def process(self, mic16k: bytes) -> bytes:
        """Microphone PCM in, echo-cancelled and guarded PCM out (whole 10 ms frames)."""
        data = self._mic + mic16k
        whole = len(data) - len(data) % _FRAME_BYTES
        self._mic = data[whole:]
        out = bytearray()
        rtc = self._rtc
        for i in range(0, whole, _FRAME_BYTES):
            ref = bytes(self._ref[:_FRAME_BYTES])
            self._skip(len(ref) // 2)
            if len(ref) < _FRAME_BYTES:
                ref += b"\x00" * (_FRAME_BYTES - len(ref))
            self._levels.append(_rms(np.frombuffer(ref, dtype="<i2")))
            self._apm.process_reverse_stream(rtc.AudioFrame(ref, RATE, 1, FRAME))
            frame = rtc.AudioFrame(data[i : i + _FRAME_BYTES], RATE, 1, FRAME)
            self._apm.process_stream(frame)
            cleaned = np.frombuffer(bytes(frame.data), dtype="<i2")
            loudest = max(self._levels)
            if loudest > SPEAKING_RMS and _rms(cleaned) < GUARD_RATIO * loudest:
                self.guarded_frames += 1
                out += b"\x00" * _FRAME_BYTES
            else:
                out += cleaned.tobytes()
        return bytes(out)
