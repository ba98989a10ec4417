"""Echo control for media transports: the server's own output cancelled from the input.

A caller on a phone or a speakerphone sends back what the bot said. :class:`EchoControl`
runs the WebRTC audio-processing module's echo canceller (through ``livekit.rtc``'s
``AudioProcessingModule``, a maintained wheel of the WebRTC APM) with the server's own
output as the far-end reference, at 16 kHz in 10 ms frames, plus a barge-in guard.

Alignment: the transport tells :meth:`EchoControl.playing` what it plays, in order, and the
reference for each 10 ms of microphone input is the next 10 ms of that playout, so the
reference advances at the microphone's pace (both are real-time clocks on the far end).
Twilio reports what was played with ``mark`` echoes (:meth:`EchoControl.played_through`
moves the reference to the position reported, either way); WebRTC hands over what its
track sends as it sends it. The canceller's own delay estimator absorbs the rest (the
echo path, 120 ms in the test).

Barge-in guard: while the reference is loud (the bot speaks), a frame whose level after
cancellation stays below ``GUARD_RATIO`` of the reference's recent level, or below
``ECHO_MARGIN`` times the echo level learned for the call, is echo-level and reaches VAD
as silence; speech louder than that passes and can interrupt.
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
#: ... and as a multiple of the echo level learned for this call (6 dB above the echo)
ECHO_MARGIN = 2.0
#: echo level (mic RMS / reference RMS) assumed until measured (-6 dB, a loud speakerphone),
#: how fast it is learned from echo the canceller removes, and how fast it fades while no
#: echo is heard (a headset: about 1.4 s of the bot speaking halves it)
INITIAL_ECHO_RATIO = 0.5
ECHO_RATIO_ALPHA = 0.1
ECHO_RATIO_DECAY = 0.995
#: how far back the guard looks at the reference (echo path + jitter)
GUARD_WINDOW_FRAMES = 40  # 400 ms
#: a mark is echoed up to one 20 ms media frame after its position played: the reference
#: is moved when it is off that by more than RESYNC_SAMPLES
MARK_LATE_SAMPLES = RATE // 100  # 10 ms, half a media frame
RESYNC_SAMPLES = RATE // 50  # 20 ms
#: reference already matched with input, kept so that it can be moved back
HISTORY_SAMPLES = RATE  # 1 s
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
        self._hist = bytearray()  # the last reference matched with input
        self._ref_pos = 0  # samples of playout consumed so far (matched with input)
        self._ref_total = 0  # samples of playout queued so far
        self._mic = b""  # an incomplete 10 ms frame
        self._levels: deque[float] = deque(maxlen=GUARD_WINDOW_FRAMES)
        self.guarded_frames = 0  # frames the guard silenced (for tests and metrics)
        #: the echo's level relative to the reference (RMS ratio), learned while the bot
        #: speaks and the canceller removes what the microphone hears
        self.echo_ratio = INITIAL_ECHO_RATIO

    # ------------------------------------------------------------------ far end
    def playing(self, pcm16k: bytes) -> int:
        """Queue what the transport plays (or will play next); returns its end position
        in samples since the start of the session's playout."""
        self._ref += pcm16k
        self._ref_total += len(pcm16k) // 2
        excess = len(self._ref) - int(MAX_REFERENCE_S * RATE) * 2
        if excess > 0:
            self._skip(excess // 2, keep=False)
        return self._ref_total

    def played_through(self, position: int) -> None:
        """The far end says its playout reached ``position`` (samples) as the input that
        arrives next was recorded: the reference moves there if it is off by more than
        ``RESYNC_SAMPLES`` (ahead: audio sent but not yet received and played when the
        input in flight was recorded; behind: input lost or late)."""
        off = position + MARK_LATE_SAMPLES - self._ref_pos
        if off > RESYNC_SAMPLES:
            self._skip(off)
        elif off < -RESYNC_SAMPLES:
            n = min(-off, len(self._hist) // 2)
            if n:
                self._ref[:0] = self._hist[-n * 2 :]
                del self._hist[-n * 2 :]
                self._ref_pos -= n

    def flush(self) -> None:
        """The transport dropped what it had not played (barge-in: Twilio clear)."""
        self._skip(len(self._ref) // 2, keep=False)

    def _skip(self, samples: int, *, keep: bool = True) -> None:
        n = min(samples, len(self._ref) // 2)
        if keep:
            self._hist += self._ref[: n * 2]
            if len(self._hist) > HISTORY_SAMPLES * 2:
                del self._hist[: len(self._hist) - HISTORY_SAMPLES * 2]
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
            if loudest > SPEAKING_RMS and self._guarded(
                data[i : i + _FRAME_BYTES], cleaned, loudest
            ):
                self.guarded_frames += 1
                out += b"\x00" * _FRAME_BYTES
            else:
                out += cleaned.tobytes()
        return bytes(out)

    def _guarded(self, raw: bytes, cleaned: np.ndarray, loudest: float) -> bool:
        """Is this frame, heard while the bot speaks, no more than its echo?

        It must pass ``GUARD_RATIO`` of the reference and ``ECHO_MARGIN`` times the echo
        level learned for this call: what the canceller leaves while it adapts (a reply's
        first words after a silence, a changed echo path) is echo-level and stays out."""
        level = _rms(cleaned)
        mic = _rms(np.frombuffer(raw, dtype="<i2"))
        ratio = min(mic / loudest, 1.0)
        # the canceller took (nearly) all of it: echo; not near-end speech it suppressed while
        # adapting (far louder than the echo so far)
        heard = mic > max(50.0, 0.05 * loudest)  # not the silence before the echo arrives
        if heard and level < 0.1 * mic and ratio <= ECHO_MARGIN * self.echo_ratio:
            self.echo_ratio += ECHO_RATIO_ALPHA * (ratio - self.echo_ratio)
        else:
            self.echo_ratio *= ECHO_RATIO_DECAY
        threshold = max(GUARD_RATIO, ECHO_MARGIN * self.echo_ratio) * loudest
        return level < threshold
