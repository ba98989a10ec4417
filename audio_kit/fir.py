"""Low-delay resampling of live input by small rational ratios (24 and 48 kHz to 16 kHz).

:class:`FirResampler`: a polyphase FIR filter whose output leaves as soon as the input it
needs has come. :func:`audio_kit.pcm.input_resampler` picks it for a session's input (and a
media transport's) where :func:`fir_ratio` says it can. :class:`PromptResampler`: what it
shares with :class:`audio_kit.pcm.Upsampler2x` (the other input resampler that waits for
nothing but an odd byte).
"""

from __future__ import annotations

from math import gcd

import numpy as np
import numpy.typing as npt

Float32Array = npt.NDArray[np.float32]
_INV_SCALE = np.float32(1.0 / 32768.0)  # (audio_kit.pcm's: int16 units -> [-1, 1))


class OddByteCarry:
    """A PCM16 stream cut anywhere: an odd byte waits in ``_carry`` for the rest of its
    sample (every input resampler: :class:`PromptResampler`'s,
    :class:`audio_kit.pcm.StreamResampler`)."""

    def __init__(self) -> None:
        self._carry = b""

    def _whole(self, pcm: bytes) -> bytes:
        """The whole samples of what came before and ``pcm`` (an odd byte waits)."""
        data = self._carry + pcm if self._carry else pcm
        if len(data) % 2:
            self._carry, data = data[-1:], data[:-1]
        else:
            self._carry = b""
        return data


class PromptResampler(OddByteCarry):
    """What a stream resampler that holds nothing back but an odd byte shares
    (:class:`FirResampler`, :class:`audio_kit.pcm.Upsampler2x`): the ``passthrough`` /
    ``holds`` properties, :meth:`process`, :meth:`process_samples` and :meth:`flush`. A
    subclass gives :meth:`_units` (its output in int16 units, rounded and clipped, from the
    whole samples :meth:`_whole` hands it) and :meth:`reset`."""

    def __init__(self, in_rate: int, out_rate: int) -> None:
        super().__init__()
        self.in_rate, self.out_rate = in_rate, out_rate

    @property
    def passthrough(self) -> bool:
        return False

    @property
    def holds(self) -> bool:
        """Only an odd byte is ever held back."""
        return bool(self._carry)

    def _units(self, pcm: bytes) -> npt.NDArray[np.float64] | npt.NDArray[np.int32]:
        raise NotImplementedError

    def process(self, pcm: bytes) -> bytes:
        return self._units(pcm).astype("<i2").tobytes()

    def process_samples(self, pcm: bytes) -> tuple[bytes, Float32Array]:
        """:meth:`process`, and the same output as float32 samples (``pcm16_to_float32``
        of the bytes)."""
        units = self._units(pcm)
        samples = units.astype(np.float32)
        samples *= _INV_SCALE
        return units.astype("<i2").tobytes(), samples

    def flush(self) -> bytes:
        """End of stream: nothing is held back; reset for a new stream."""
        self.reset()
        return b""

    def reset(self) -> None:
        raise NotImplementedError


class FirResampler(PromptResampler):
    """Stateful PCM16 mono resampling by a small rational ratio (24 -> 16 kHz is 2/3,
    48 -> 16 kHz 1/3) with a polyphase FIR filter, for input that must not wait.

    Every sample out is given as soon as the input it needs has come: 20 ms in, 20 ms out,
    the filter's own delay 1.25 ms (:attr:`delay`, whole output samples). soxr's stream
    resampler (:class:`audio_kit.pcm.StreamResampler`) held 24 and 48 kHz input back ~22 ms
    on average and up to ~37 ms (its output comes in blocks); python-soxr has no setting
    without the blocks (its ``vr`` mode holds 10-12 ms and costs more), and libsamplerate's
    fastest sinc (the ``samplerate`` wheel: 1.2 ms) costs 31 us per 20 ms at 24 kHz and
    83 us at 48 kHz, this ~9 and ~12 us (``process_samples`` of 20 ms on a 2-vCPU
    Xeon; soxr: ~6 us).

    The filter: a Kaiser-windowed sinc at the upsampled rate, flat (within 0.01 dB) to 90%
    of the lower rate's Nyquist frequency (7.2 kHz for 16 kHz), at least 65 dB down from
    110% of it (8.8 kHz), where anything would fold back above 7.2 kHz. (With 85% / 115%,
    14 fewer taps, the live transcript of "Fail better" at 24 kHz became "Failed better":
    Whisper hears up to 8 kHz.) Its taps are
    integers (units of 2**-20) and the input int16, so each output sample is an exact sum
    in float64 whatever order BLAS adds in: the output is the same bytes however the
    stream is cut into calls, run after run. The same interface as
    :class:`audio_kit.pcm.StreamResampler`; nothing is held back but an odd byte, so
    :meth:`flush` has nothing to give (the last 1.25 ms of a stream stays in the filter)."""

    _UNIT = float(2**20)  # the taps' unit: 2**-20
    BLOCK = 8  # groups of outputs a row of the product gives (of 4 to 32, 8 was fastest)
    PASS, STOP, ATTEN_DB = 0.9, 1.1, 65.0  # of the lower rate's Nyquist frequency

    def __init__(self, in_rate: int, out_rate: int) -> None:
        if in_rate <= 0 or out_rate <= 0:
            raise ValueError(f"sample rates must be positive, got {in_rate} -> {out_rate}")
        super().__init__(in_rate, out_rate)
        g = gcd(in_rate, out_rate)
        self.up, self.down = out_rate // g, in_rate // g  # L, M
        up, down = self.up, self.down
        rate = in_rate * up  # the filter runs (notionally) at the upsampled rate
        nyquist = min(in_rate, out_rate) / 2
        width = 2 * np.pi * (self.STOP - self.PASS) * nyquist / rate
        taps = int(np.ceil((self.ATTEN_DB - 8) / (2.285 * width))) + 1  # Kaiser's estimate
        taps += -(taps - 1) % (2 * down)  # its delay, (taps - 1) / 2, whole output samples
        #: the filter's delay in output samples (a sample in comes out this much later)
        self.delay = (taps - 1) // (2 * down)
        per_phase = -(-taps // up)
        per_phase = -(-per_phase // down) * down  # whole rows of ``down`` input samples
        beta = 0.1102 * (self.ATTEN_DB - 8.7)
        cutoff = (self.PASS + self.STOP) / 2 * nyquist / rate  # cycles per sample
        t = np.arange(taps) - (taps - 1) / 2
        h = 2 * cutoff * np.sinc(2 * cutoff * t) * np.kaiser(taps, beta) * up
        units = np.zeros(per_phase * up)  # (zero taps after the filter's: whole rows)
        units[:taps] = np.round(h * self._UNIT)
        #: the filter's taps in units of 2**-20, at the upsampled rate
        self.taps_units = units[:taps].copy()
        # Outputs come in groups of ``up``: output j * up + r has its newest input at
        # j * down + r * down // up and the taps of phase r * down % up, so all of a group's
        # outputs read one window of ``span`` input samples from j * down - (P - 1). A block
        # of ``BLOCK`` groups reads ``(BLOCK - 1) * down + span`` samples, and a call is one
        # matrix product: its blocks' inputs (rows ``BLOCK * down`` samples apart, so they
        # overlap) times ``_bank`` (column b * up + r: output r of the block's group b, its
        # taps where its own samples lie, 0 elsewhere). The taps are scaled by 2**-20 here:
        # still exact.
        offsets = [r * down // up for r in range(up)]
        self._span = per_phase + offsets[-1]
        self._block = (self.BLOCK - 1) * down + self._span
        self._bank = np.zeros((self._block, self.BLOCK * up))
        for r, off in enumerate(offsets):
            tap = units[r * down % up :: up][::-1] / self._UNIT
            for b in range(self.BLOCK):
                self._bank[b * down + off : b * down + off + per_phase, b * up + r] = tap
        self._taps = per_phase
        #: input samples kept before the next call's: the first group's window may start
        #: up to ``down - 1`` samples before the last output's
        self._keep = per_phase + down
        self._tail = np.zeros(self._block)  # past the newest input (a last block's)
        self._history: npt.NDArray[np.float64] = np.zeros(self._keep)
        self._in = 0  # input samples taken
        self._out = 0  # output samples given

    def _units(self, pcm: bytes) -> npt.NDArray[np.float64]:
        x = np.frombuffer(self._whole(pcm), dtype="<i2")
        up, down, keep = self.up, self.down, self._keep
        total = self._in + x.size
        end = -(-(total * up) // down)  # outputs whose newest input sample has come
        first, last = self._out // up, -(-end // up)  # the groups they fall in
        buf = np.concatenate((self._history, x, self._tail))  # buf[0]: input self._in - keep
        self._history = buf[x.size : x.size + keep]
        if end == self._out:
            self._in = total
            return np.empty(0)
        start = first * down - (self._taps - 1) - (self._in - keep)
        blocks = -(-(last - first) // self.BLOCK)
        rows = np.ndarray(
            (blocks, self._block), np.float64, buf, start * 8, (self.BLOCK * down * 8, 8)
        )
        product: npt.NDArray[np.float64] = np.dot(rows, self._bank)
        y = product.reshape(-1)[self._out - first * up : end - first * up]
        self._in, self._out = total, end
        np.rint(y, out=y)
        np.minimum(y, 32767.0, out=y)
        np.maximum(y, -32768.0, out=y)
        return y

    def reset(self) -> None:
        self._carry = b""
        self._history = np.zeros(self._keep)
        self._in = 0
        self._out = 0


#: ratios :class:`FirResampler` takes (up to L/M with L <= 4 and M <= 6: 24, 32, 48 kHz to
#: 16 kHz and back); others (44.1 kHz: 160/441) keep soxr
FIR_MAX_UP, FIR_MAX_DOWN = 4, 6


def fir_ratio(in_rate: int, out_rate: int) -> bool:
    g = gcd(in_rate, out_rate)
    return in_rate != out_rate and out_rate // g <= FIR_MAX_UP and in_rate // g <= FIR_MAX_DOWN
