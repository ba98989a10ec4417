"""Echo control for media transports: the server's own output cancelled from the input.

A caller on a phone or a speakerphone sends back what the bot said. :class:`EchoControl`
runs the WebRTC audio-processing module's echo canceller (through ``livekit.rtc``'s
``AudioProcessingModule``, a maintained wheel of the WebRTC APM) with the server's own
output as the far-end reference, at 16 kHz in 10 ms frames, and decides per frame whether
the caller is talking (:class:`EchoPath`), so that a caller is never swallowed.

Alignment: the transport tells :meth:`EchoControl.playing` what it plays, in order, and the
reference for each 10 ms of microphone input is the next 10 ms of that playout, so the
reference advances at the microphone's pace (both are real-time clocks on the far end).
Twilio reports what was played with ``mark`` echoes (:meth:`EchoControl.played_through`
moves the reference to the position reported, either way); WebRTC hands over what its
track sends as it sends it. What is left of the delay (the far end's own echo path,
0-300 ms) is measured by :class:`EchoPath`.

Why not the canceller alone: WebRTC's AEC3 suppresses the near end while it has not
converged, and with no echo path at all (a line that carries no echo, a headset) it never
converges: a caller talking over the reply came out as silence, so on a call a barge-in
never happened. So:

- :class:`EchoPath` measures the echo from the signals themselves every 100 ms while the
  bot speaks: the cross-correlation of the microphone with the reference over lags
  0-300 ms gives the path's delay and its one-lag gain (a regression, which the caller's
  speech does not bias: it is uncorrelated with the reference). The microphone's level
  against the reference's bounds the echo's from above (the caller and noise only add to
  it); where the window is not mostly echo, the gain (times ``SPREAD``) is the echo's level;
  the least of the recent windows' is the path's. A line with no echo is known as such
  from the first window that could have heard the longest echo (~0.4 s into a reply).
- A frame heard while the bot speaks is the caller's (double-talk) when the microphone,
  less the echo the measured path predicts, is ``NEAR_MARGIN`` (6 dB) above the echo that
  prediction leaves; the caller's speech then holds for ``HANGOVER_FRAMES``. Any other
  frame is echo and reaches VAD as silence (the guard).
- The prediction is a 5-tap filter around the measured lag, fitted by least squares on
  each window: one lag and one gain left a quarter of a call's echo unexplained (its
  fractional delay: the far end plays 8 kHz, the reference is the server's 16 kHz).
- The caller's frames pass as the canceller cleaned them where it kept them. Where it
  suppressed them, they pass as the microphone less the predicted echo: while the canceller
  has not converged, and once it has, where the measured filter explains the echo as well
  (:meth:`EchoPath.trusted`). AEC3 holds back the first ~70 ms of double-talk even once
  converged, and the VAD then heard the caller start that much later.
- Until the first measurement the path is assumed loud (``INITIAL_ECHO_RATIO``, -6 dB: a
  speakerphone), so a reply's first words never interrupt themselves.
- The prediction holds only for the alignment it was measured at. Every time the
  playout starts again (a new reply after the reference ran out, a resume after a Twilio
  ``clear``) or a mark moves the reference, the far end's playout and the reference line up
  again to within a media frame, not a sample: the old lag then predicts the wrong samples
  and the echo looked like the caller (the echo of a resumed reply paused it again). So
  after such a realignment (:meth:`EchoPath.realign`) the echo counts as wholly unexplained
  (the caller must be ``NEAR_MARGIN`` above the echo's level) until a window after it that
  is mostly echo measures the lag again: as soon as ``MIN_WINDOW_FRAMES`` of it, searching
  lags up to the old one and ``REALIGN_LAG_MS`` beyond.
"""

from __future__ import annotations

from collections import deque

import numpy as np

RATE = 16000
FRAME = RATE // 100  # 10 ms, what the APM processes
_FRAME_BYTES = FRAME * 2
_FRAME8 = FRAME // 2  # a frame at 8 kHz, where the path is measured
#: reference RMS (int16) above which the bot counts as speaking
SPEAKING_RMS = 200.0
#: echo level (mic RMS / reference RMS) assumed until measured (-6 dB, a loud speakerphone)
INITIAL_ECHO_RATIO = 0.5
#: a frame is the caller's when it is this many times the echo left in it (6 dB) ...
NEAR_MARGIN = 2.0
#: ... and above this RMS (line noise alone is not a caller)
NEAR_FLOOR_RMS = 100.0
#: the caller's speech is believed to go on this long after a frame above the echo
HANGOVER_FRAMES = 8  # 80 ms
#: a window whose correlation with the reference reaches this is mostly echo: its level is
#: the path's at once (a louder path), and one lag explains that much of the echo
ECHO_DOMINANT = 0.6
#: a path spread over many lags correlates at its strongest with up to 1/SPREAD of its echo
SPREAD = 1.5
#: the least share of the echo a measured path is believed to leave unexplained (-20 dB)
RESIDUAL_FLOOR = 0.1
#: the path's level is the least of this many recent windows' (one without the caller)
LEVEL_WINDOWS = 15  # 1.5 s
#: echo delays searched (ms; Twilio's marks align the reference to within a media frame)
MAX_LAG_MS = 300
#: the path is measured every ANALYSE_FRAMES over the last WINDOW_FRAMES of microphone
ANALYSE_FRAMES = 10  # 100 ms
WINDOW_FRAMES = 40  # 400 ms
MIN_WINDOW_FRAMES = 20
#: after a realignment, lags searched reach this far past the last measured one (ms)
REALIGN_LAG_MS = 60
#: frames kept: the window plus the longest lag
_KEEP_FRAMES = WINDOW_FRAMES + MAX_LAG_MS // 10 + 4
#: the prediction is a short filter around the measured lag (8 kHz samples either side),
#: fitted by least squares on each window: one lag and one gain leave the echo's fractional
#: delay and the line's filtering unexplained (a quarter of the echo on a call: the far end
#: plays 8 kHz and the reference comes from the server's 16 kHz)
TAPS_SIDE = 2
#: the filter's prediction is trusted over a converged canceller's output when it explains
#: this much of the echo (a window's correlation with its prediction; an echo path with a
#: reverberant tail stays below it: ~0.85 at a direct-to-reverberant ratio of +3 dB)
TRUSTED_FIT = 0.97
#: the canceller counts as converged when frames of echo alone leave it below this share
#: of the microphone (-10 dB), smoothed over frames by CONVERGED_ALPHA
CONVERGED_SHARE = 0.3
CONVERGED_ALPHA = 0.05
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


def _half(pcm: np.ndarray) -> np.ndarray:
    """16 -> 8 kHz by averaging pairs (phone audio has nothing above 4 kHz)."""
    x = pcm[: pcm.size - pcm.size % 2].astype(np.float64)
    return 0.5 * (x[0::2] + x[1::2])


class EchoPath:
    """The echo path from the far end's playout to the microphone, measured (pure numpy).

    Fed one 10 ms frame pair at a time (:meth:`add`): a microphone frame and the reference
    played as it was heard. :attr:`ratio` is the echo's level relative to the reference
    (RMS), :attr:`delay` the path's delay (frames), :attr:`gain` its one-lag gain and
    :attr:`fit` how much of the echo that one lag explains."""

    def __init__(self) -> None:
        self._mic: deque[np.ndarray] = deque(maxlen=_KEEP_FRAMES)
        self._ref: deque[np.ndarray] = deque(maxlen=_KEEP_FRAMES)
        self._ref_rms: deque[float] = deque(maxlen=_KEEP_FRAMES)
        self._levels: deque[float] = deque(maxlen=LEVEL_WINDOWS)
        self._since = 0  # frames since the last measurement
        self.ratio = INITIAL_ECHO_RATIO
        self.delay: int | None = None  # None: not measured yet
        self.lag = 0  # samples at 8 kHz
        self.gain = 0.0
        #: the prediction filter: weights of lags ``lag - TAPS_SIDE`` .. ``lag + TAPS_SIDE``
        self.taps = np.zeros(2 * TAPS_SIDE + 1)
        self.correlation = 0.0  # of the latest window
        #: how much of the echo the filter explains: the best window that was mostly echo
        #: since the last realignment (0: none yet; the caller's speech only lowers a
        #: window's, and the path is distrusted while the caller talks otherwise)
        self.fit = 0.0
        #: and the median of those windows' (0: none yet), which :meth:`trusted` asks: where
        #: a codec that does not keep the waveform sits on the path (Opus on WebRTC, twice)
        #: most windows fit 0.89-0.96 and a few 0.98, and the best one vouched for a
        #: prediction that left half the echo, heard as the caller. (The upper quartile
        #: still let one WebRTC echo-only trial in 10 pause; on a call, where the first
        #: windows after a realignment fit 0.67-0.8 and the caller's own lower a few, the
        #: median and the best gave the same heard stop.)
        self.typical_fit = 0.0
        self._fits: deque[float] = deque(maxlen=LEVEL_WINDOWS)
        #: the lag was measured on the reference's current alignment (see :meth:`realign`)
        self.aligned = False
        self._since_realign = 0  # frames added since the last realignment
        self.realignments = 0  # (tests and metrics)

    def realign(self) -> None:
        """The reference was moved against the far end's playout (the playout started
        again, or a mark moved it): the measured lag may be off by up to a media frame, so
        the prediction is not trusted until a window after this measures it again."""
        if self.aligned or self._since_realign > 1:  # (once for a run of frames)
            self.realignments += 1
        self.aligned = False
        self._since_realign = 0

    def add(self, mic: np.ndarray, ref: np.ndarray) -> None:
        """One 10 ms frame pair at 16 kHz; kept and measured at 8 kHz (the band a phone
        line carries; the prediction then holds nothing the line removed)."""
        ref8 = _half(ref)
        self._mic.append(_half(mic))
        self._ref.append(ref8)
        self._ref_rms.append(_rms(ref8))
        self._since_realign += 1
        self._since += 1
        if self._since >= ANALYSE_FRAMES:
            self._since = 0
            self._measure()

    def speaking(self) -> bool:
        """Could the microphone hear the bot now (the reference was loud within the
        longest lag)?"""
        return max(self._ref_rms, default=0.0) > SPEAKING_RMS

    def echo_level(self) -> float:
        """The RMS of the echo expected in the latest microphone frame."""
        levels = list(self._ref_rms)
        if self.delay is not None:  # around the measured delay (it may be off a frame)
            end = len(levels) - self.delay
            levels = levels[max(0, end - 3) : max(0, end + 2)]
        return self.ratio * max(levels, default=0.0)

    def unexplained(self) -> float:
        """The RMS of the echo that :meth:`predicted` leaves in the latest frame: all of
        it until a window that was mostly echo was seen; after, the part one lag does not
        explain (a spread or distorted path), at least ``RESIDUAL_FLOOR`` of it."""
        echo = self.echo_level()
        if self.fit == 0.0 or not self.aligned:
            return echo
        return echo * max(float(np.sqrt(max(1.0 - self.fit**2, 0.0))), RESIDUAL_FLOOR)

    def trusted(self) -> bool:
        """Does the measured filter explain the echo as well as a converged canceller
        (aligned, at least ``TRUSTED_FIT`` of it in the median window, and predicting from
        reference that was lined up after the last realignment)? A reverberant path's tail
        is beyond its few taps; a codec that does not keep the waveform (Opus) leaves what
        no filter predicts; reference from before a realignment may not be what the far end
        played (a reference that ran out while the far end still played is padded with
        silence)."""
        return (
            self.aligned
            and self.typical_fit >= TRUSTED_FIT
            and self._since_realign * _FRAME8 > self.lag + TAPS_SIDE + _FRAME8
        )

    def measured_echo(self) -> bool:
        """Was an echo measured on this path's alignment (a window mostly echo)? (Only
        such a window sets :attr:`aligned`, and it sets :attr:`fit` to at least
        ``ECHO_DOMINANT``.)"""
        return self.aligned and self.gain != 0.0

    def latest_mic(self) -> np.ndarray:
        return self._mic[-1]

    def residual(self) -> np.ndarray:
        """The latest microphone frame (8 kHz) less the echo the measured path predicts."""
        mic = self._mic[-1]
        if self.delay is None or self.gain == 0.0:
            return mic
        frames = self._ref
        # mic[i] hears ref[i - lag - j] through tap j (-TAPS_SIDE..TAPS_SIDE): the reference
        # from (lag + TAPS_SIDE) before this frame's start to (lag - TAPS_SIDE) before its end
        lo = self.lag + TAPS_SIDE  # samples before the frame's start
        need = -(-lo // _FRAME8) + 1  # frames back to reach them (and this one)
        if need > len(frames):
            return mic
        flat = np.concatenate([frames[i] for i in range(len(frames) - need, len(frames))])
        start = flat.size - _FRAME8 - lo
        width = _FRAME8 + 2 * TAPS_SIDE
        seg = flat[start : start + width]
        if seg.size < width:  # the latest taps reach past the reference heard so far
            seg = np.concatenate((seg, np.zeros(width - seg.size)))
        # mic sample k hears seg[k + TAPS_SIDE - j] through tap j
        return mic - np.convolve(seg, self.taps, mode="valid")

    def _measure(self) -> None:
        n = min(len(self._mic), WINDOW_FRAMES)
        top = MAX_LAG_MS * 8  # lags in 8 kHz samples
        reach = top  # the longest lag the window must have heard
        if not self.aligned and self.delay is not None:
            # only frames since the realignment, and lags near the one measured before it
            n = min(n, self._since_realign)
            reach = min(top, self.lag + REALIGN_LAG_MS * 8)
        if n < MIN_WINDOW_FRAMES:
            return
        mic = np.concatenate(list(self._mic)[-n:])
        # the frames before the first one kept were silence (the session's start)
        ref = np.concatenate(list(self._ref))[-(mic.size + top) :]
        seg = np.concatenate((np.zeros(mic.size + top - ref.size), ref))
        # mic[i] was heard as seg[top + i] played; at lag k its echo is seg[top + i - k]
        # shift s = top - k: sum_i mic[i] * seg[i + s], for the lags k searched (0..reach)
        shifts = np.arange(top - reach, top + 1)
        csum = np.concatenate(([0.0], np.cumsum(seg**2)))
        ref_energy = csum[shifts + mic.size] - csum[shifts]
        loud = ref_energy / mic.size > SPEAKING_RMS**2
        if not loud.all():  # the window might have missed an echo that comes late
            return
        mic_energy = float(np.dot(mic, mic))
        if mic_energy <= 0.0:  # digital silence while the bot spoke: no echo at all
            self.taps = np.zeros(2 * TAPS_SIDE + 1)
            self._found(0.0, 0.0, 0, 0.0)
            return
        size = 1 << int(np.ceil(np.log2(seg.size + mic.size)))
        full = np.fft.irfft(np.fft.rfft(seg, size) * np.conj(np.fft.rfft(mic, size)), size)
        corr = full[shifts]
        rho = corr / np.sqrt(ref_energy * mic_energy)
        best = int(np.argmax(np.abs(rho)))
        r = float(rho[best])
        gain = float(corr[best] / ref_energy[best])
        # the microphone's level bounds the echo's from above (the caller and noise only add
        # to it); where the window is not mostly echo, the correlated part is the echo
        # (a spread path correlates at its strongest lag with part of it: SPREAD)
        level = float(np.sqrt(mic_energy / ref_energy[best]))
        if abs(r) < ECHO_DOMINANT:
            level = min(level, SPREAD * abs(gain))
        lag = top - int(shifts[best])
        self.taps, share = self._filter(mic, seg, top, lag, gain)
        self._found(level, gain, lag, r, share)

    @staticmethod
    def _filter(
        mic: np.ndarray, seg: np.ndarray, top: int, lag: int, gain: float
    ) -> tuple[np.ndarray, float]:
        """The least-squares prediction filter around ``lag`` over the window, and the
        share of the microphone's energy it leaves (the one-lag gain alone where the
        fit is singular)."""
        n = mic.size
        padded = np.concatenate((np.zeros(TAPS_SIDE), seg, np.zeros(TAPS_SIDE)))
        at = TAPS_SIDE + top - lag  # mic[i] hears padded[at + i - j] through tap j
        cols = [padded[at - j : at - j + n] for j in range(-TAPS_SIDE, TAPS_SIDE + 1)]
        x = np.stack(cols, axis=1)
        try:
            taps = np.linalg.solve(x.T @ x, x.T @ mic)
        except np.linalg.LinAlgError:
            taps = np.zeros(2 * TAPS_SIDE + 1)
            taps[TAPS_SIDE] = gain
        left = mic - x @ taps
        return taps, float(np.dot(left, left) / max(np.dot(mic, mic), 1e-9))

    def _found(
        self, level: float, gain: float, lag: int, correlation: float, share: float = 1.0
    ) -> None:
        """One window's measurement (``lag`` in 8 kHz samples, ``level`` its mic/reference
        RMS ratio at that lag): the path's level is the least of the recent windows', or a
        window's that was mostly echo at once (a louder path is believed without waiting)."""
        self.correlation = correlation
        if abs(correlation) >= ECHO_DOMINANT:
            # how much of the window the filter explains (at least what one lag does)
            if not self.aligned:
                self._fits.clear()
            self._fits.append(max(abs(correlation), float(np.sqrt(max(1.0 - share, 0.0)))))
            self.fit = max(self._fits)
            self.typical_fit = float(np.median(self._fits))
            self._levels.clear()
            self.aligned = True  # (a window of double-talk does not say where the lag is)
        self._levels.append(level)
        self.ratio = min(self._levels)
        self.gain = gain
        self.lag = lag
        self.delay = lag // _FRAME8


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
        self.path = EchoPath()
        self.guarded_frames = 0  # frames heard as echo and silenced (for tests and metrics)
        self.near_frames = 0  # frames heard as the caller's while the bot spoke
        self._hold = 0  # frames the caller's speech is still believed to go on
        #: what the canceller leaves of frames of echo alone (smoothed share of the mic)
        self.left = 1.0

    @property
    def echo_ratio(self) -> float:
        """The echo's level relative to the reference (RMS), as measured."""
        return self.path.ratio

    @property
    def converged(self) -> bool:
        """Does the canceller remove most of the echo (frames of echo alone)?"""
        return self.left < CONVERGED_SHARE

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
            self.path.realign()
        elif off < -RESYNC_SAMPLES:
            n = min(-off, len(self._hist) // 2)
            if n:
                self._ref[:0] = self._hist[-n * 2 :]
                del self._hist[-n * 2 :]
                self._ref_pos -= n
                self.path.realign()

    def flush(self) -> None:
        """The transport dropped what it had not played (barge-in: Twilio clear)."""
        self._skip(len(self._ref) // 2, keep=False)
        self.path.realign()

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
            if len(ref) < _FRAME_BYTES:  # the playout ran out: it starts again out of line
                ref += b"\x00" * (_FRAME_BYTES - len(ref))
                self.path.realign()
            raw = data[i : i + _FRAME_BYTES]
            mic = np.frombuffer(raw, dtype="<i2")
            self.path.add(mic, np.frombuffer(ref, dtype="<i2"))
            self._apm.process_reverse_stream(rtc.AudioFrame(ref, RATE, 1, FRAME))
            frame = rtc.AudioFrame(raw, RATE, 1, FRAME)
            self._apm.process_stream(frame)
            out += self._decide(mic, np.frombuffer(bytes(frame.data), dtype="<i2"))
        return bytes(out)

    def _decide(self, mic: np.ndarray, cleaned: np.ndarray) -> bytes:
        """What VAD hears of one frame: the canceller's output while the bot is silent;
        while it speaks, the caller's speech (double-talk) or silence (echo alone)."""
        path = self.path
        if not path.speaking():
            self._hold = 0
            return cleaned.tobytes()
        # the microphone less the echo the measured path predicts, against the echo that
        # prediction leaves (all of it until the path is known); at 8 kHz
        residual = path.residual()
        # (a prediction off the true lag adds to the microphone: the caller is no louder
        # than the microphone itself)
        level = min(_rms(residual), _rms(path.latest_mic()))
        if level > max(NEAR_MARGIN * path.unexplained(), NEAR_FLOOR_RMS):
            self._hold = HANGOVER_FRAMES
        elif self._hold > 0:
            self._hold -= 1  # the caller's speech dips between syllables
        else:
            heard = _rms(mic)
            if path.delay is not None and NEAR_FLOOR_RMS < heard <= NEAR_MARGIN * path.echo_level():
                # echo alone, as loud as the measured path says: what the canceller leaves
                share = min(_rms(cleaned) / heard, 1.0)
                self.left += CONVERGED_ALPHA * (share - self.left)
            self.guarded_frames += 1
            return b"\x00" * _FRAME_BYTES
        self.near_frames += 1
        if _rms(cleaned) >= 0.5 * level or (
            not path.trusted() and (self.converged or path.measured_echo())
        ):
            return cleaned.tobytes()  # it kept the caller, or its filter is the better one
        # it suppressed the caller (double-talk before it converged, no echo path, or the
        # first ~70 ms of double-talk, which AEC3 holds back even once converged): the
        # microphone less the predicted echo, back at 16 kHz
        less = np.repeat(residual - path.latest_mic(), 2)
        return bytes(np.clip(mic + less, -32768, 32767).astype("<i2").tobytes())
