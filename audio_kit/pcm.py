"""PCM helpers: int16 <-> float32 conversion and soxr resampling (one-shot and streaming).

Audio crossing the engine is PCM16 mono little-endian bytes; model code works on float32
numpy arrays in [-1, 1]. Resampling is done by soxr, except a live session's input, which
must not wait: soxr's streaming resampler holds ~22 ms of it on average (up to ~37 ms, its
output comes in blocks), and every speech start and end was heard that much later. Input
at 8 kHz is brought to 16 kHz by :class:`Upsampler2x`, at 24 and 48 kHz (and other small
ratios) by :class:`FirResampler`; :func:`input_resampler` picks.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import soxr

from audio_kit.fir import FirResampler, OddByteCarry, PromptResampler, fir_ratio
from duplex_contract.audible import first_audible
from duplex_contract.audio import duration_ms as contract_duration_ms

Float32Array = npt.NDArray[np.float32]
Int16Array = npt.NDArray[np.int16]

_SCALE = 32768.0
_INV_SCALE = np.float32(1.0 / 32768.0)
#: soxr quality used everywhere: "HQ" is transparent for speech and cheap (a few us per 20 ms).
QUALITY = "HQ"


def pcm16_to_float32(pcm: bytes | bytearray | memoryview) -> Float32Array:
    """PCM16 little-endian bytes -> float32 samples in [-1, 1)."""
    if len(pcm) % 2:
        raise ValueError(f"PCM16 data must have an even number of bytes, got {len(pcm)}")
    out: Float32Array = np.frombuffer(pcm, dtype="<i2").astype(np.float32)
    out *= _INV_SCALE  # exact: a power of two, the same as dividing by 32768
    return out


def _round_units(units: Float32Array) -> Float32Array:
    """float32 in int16 units -> rounded and clipped to [-32768, 32767], in place (ufuncs,
    not ``np.clip``'s Python wrapper: this runs for every 20 ms of every session's input)."""
    np.rint(units, out=units)
    np.minimum(units, np.float32(32767.0), out=units)
    np.maximum(units, np.float32(-32768.0), out=units)
    return units


def float32_to_int16(audio: npt.NDArray[np.floating]) -> Int16Array:
    """float samples in [-1, 1] -> int16 (rounded, clipped)."""
    scaled = np.asarray(audio, dtype=np.float32) * np.float32(_SCALE)
    out: Int16Array = _round_units(scaled).astype(np.int16)
    return out


def float32_to_pcm16(audio: npt.NDArray[np.floating]) -> bytes:
    """float samples in [-1, 1] -> PCM16 little-endian bytes (clipped)."""
    return float32_to_int16(audio).astype("<i2", copy=False).tobytes()


def resample(audio: Float32Array, in_rate: int, out_rate: int) -> Float32Array:
    """Resample a whole float32 mono signal with soxr."""
    if in_rate == out_rate or audio.size == 0:
        return np.asarray(audio, dtype=np.float32)
    out = soxr.resample(np.asarray(audio, dtype=np.float32), in_rate, out_rate, quality=QUALITY)
    return np.asarray(out, dtype=np.float32)


def resample_pcm16(pcm: bytes, in_rate: int, out_rate: int) -> bytes:
    """Resample a whole PCM16 mono buffer with soxr."""
    if in_rate == out_rate:
        return pcm
    return float32_to_pcm16(resample(pcm16_to_float32(pcm), in_rate, out_rate))


def duration_ms(pcm: bytes, sample_rate: int) -> float:
    """Duration of a PCM16 mono buffer in milliseconds."""
    return contract_duration_ms(len(pcm), sample_rate)


def samples_for_ms(sample_rate: int, ms: float) -> int:
    return max(1, round(sample_rate * ms / 1000.0))


class StreamResampler(OddByteCarry):
    """Stateful PCM16 mono resampler for audio that arrives in pieces (soxr ResampleStream).

    ``process`` takes any number of bytes (an odd trailing byte is kept for the next call)
    and returns what soxr has ready; ``flush`` drains the filter tail at the end of a stream.
    The output is continuous across calls: no clicks at chunk borders, unlike resampling
    each chunk alone. It is also the same however the stream is cut into calls, and the
    same every time: soxr resamples in float32 and the result is rounded to int16 here
    (soxr's own int16 output adds random dither, so the same audio came out different in
    every run and for every append size, and the live transcript with it). Not
    thread-safe: one instance per stream.
    """

    def __init__(self, in_rate: int, out_rate: int) -> None:
        if in_rate <= 0 or out_rate <= 0:
            raise ValueError(f"sample rates must be positive, got {in_rate} -> {out_rate}")
        super().__init__()
        self.in_rate = in_rate
        self.out_rate = out_rate
        self._stream: soxr.ResampleStream | None = (
            None
            if in_rate == out_rate
            else soxr.ResampleStream(in_rate, out_rate, 1, dtype="float32", quality=QUALITY)
        )
        self._fed = False  # audio went into the stream since it was last flushed or reset

    @property
    def passthrough(self) -> bool:
        return self._stream is None

    @property
    def holds(self) -> bool:
        """Does it hold back input it has not given out (an odd byte, soxr's delay)?"""
        return bool(self._carry) or self._fed

    def process(self, pcm: bytes) -> bytes:
        data = self._whole(pcm)
        if self._stream is None or not data:
            return data
        return self._resampled(data).astype("<i2").tobytes()

    def process_samples(self, pcm: bytes) -> tuple[bytes, Float32Array]:
        """:meth:`process`, and the same output as float32 samples, exactly
        ``pcm16_to_float32`` of the bytes (for a VAD, without converting them back)."""
        data = self._whole(pcm)
        if self._stream is None or not data:
            return data, pcm16_to_float32(data)
        units = self._resampled(data)
        if not units.size:  # soxr's output comes in blocks: often nothing for a frame
            return b"", units
        out = units.astype("<i2").tobytes()
        units *= _INV_SCALE
        return out, units

    def _resampled(self, data: bytes) -> Float32Array:
        """soxr on the int16 values as float32, not scaled to [-1, 1): resampling is linear
        and a power-of-two scale is exact in floating point, so the output is bit for bit
        the scaled one's times 32768, two array passes fewer per call; rounded, clipped."""
        assert self._stream is not None
        self._fed = True
        out = self._stream.resample_chunk(np.frombuffer(data, "<i2").astype(np.float32))
        return _round_units(out) if out.size else out

    def flush(self) -> bytes:
        """End of stream: return the remaining output and reset for a new stream."""
        self._carry = b""
        self._fed = False
        if self._stream is None:
            return b""
        out = self._stream.resample_chunk(np.zeros(0, dtype=np.float32), last=True)
        self._stream.clear()
        return _round_units(out).astype("<i2").tobytes()

    def reset(self) -> None:
        """Drop buffered state (e.g. after a barge-in flushed the stream)."""
        self._carry = b""
        self._fed = False
        if self._stream is not None:
            self._stream.clear()


#: A 20 ms window is "sound" when its RMS is above this fraction of the loudest window's
#: (-40 dB) and above an absolute floor (-80 dBFS); quieter edges are trimmed.
EDGE_REL = 0.01
EDGE_FLOOR = 1e-4
#: Audio after a speculated pause counts as silence below this fraction of the speech's
#: loudest window: the edge_trim threshold, so a tail it accepts is one edge_trim would cut
#: anyway, and the guess transcribes exactly what the whole turn would.
TAIL_REL = EDGE_REL


class Upsampler2x(PromptResampler):
    """Stateful PCM16 mono 2x upsampling (8 -> 16 kHz) by linear interpolation, for input.

    No delay and no blocks: each input sample gives two output samples at once, the
    midpoint with the sample before (integer, rounded down) and the sample itself, so a
    VAD hears telephone audio as it arrives. A stream resampler (:class:`StreamResampler`,
    soxr HQ) holds 8 kHz input back ~30 ms and releases it in ~100 ms blocks, which made a
    G.711 client's speech start and stop late by that much (``bench/vad_delay.py``).
    Telephone audio has nothing above 4 kHz to lose to the simpler filter. The same
    interface as :class:`StreamResampler`; :func:`upsample2x_pcm16` is the same on a whole
    buffer (the batch route, so that a clip is heard as a live stream of it is)."""

    def __init__(self) -> None:
        super().__init__(8000, 16000)
        self._last = 0  # the previous input sample (the interpolation's one of state)

    def _units(self, pcm: bytes) -> npt.NDArray[np.int32]:
        x = np.frombuffer(self._whole(pcm), dtype="<i2").astype(np.int32)
        out = np.empty(x.size * 2, dtype=np.int32)
        if x.size:
            prev = np.empty_like(x)
            prev[0] = self._last
            prev[1:] = x[:-1]
            out[0::2] = (prev + x) >> 1
            out[1::2] = x
            self._last = int(x[-1])
        return out

    def reset(self) -> None:
        self._carry = b""
        self._last = 0


def upsample2x_pcm16(pcm: bytes) -> bytes:
    """A whole PCM16 buffer 8 -> 16 kHz as :class:`Upsampler2x` streams it."""
    return Upsampler2x().process(pcm)


InputResampler = StreamResampler | Upsampler2x | FirResampler


def input_resampler(in_rate: int, out_rate: int) -> InputResampler:
    """The resampler of a session's input audio, none of which waits: :class:`Upsampler2x`
    for 8 -> 16 kHz, :class:`FirResampler` for small ratios (24 and 48 kHz), soxr's
    :class:`StreamResampler` otherwise (and as the passthrough at one rate)."""
    if in_rate == 8000 and out_rate == 16000:
        return Upsampler2x()
    if fir_ratio(in_rate, out_rate):
        return FirResampler(in_rate, out_rate)
    return StreamResampler(in_rate, out_rate)


def _window_rms(audio: Float32Array, win: int) -> npt.NDArray[np.float32]:
    n = audio.size // win
    if n == 0:
        return np.zeros(0, dtype=np.float32)
    frames = audio[: n * win].reshape(n, win).astype(np.float32)
    rms: npt.NDArray[np.float32] = np.sqrt(np.mean(frames * frames, axis=1))
    return rms


def edge_trim(audio: Float32Array, sample_rate: int, margin_ms: float) -> Float32Array:
    """The utterance with its quiet edges made canonical, for a transcription that does not
    depend on where a VAD (or a file) cut it.

    A sample is "sound" when the 20 ms window centred on it (the audio taken as silence
    beyond its ends) is louder than ``EDGE_REL`` of the loudest such window. Leading audio
    is cut to ``margin_ms`` before the first sound; trailing audio at the end of the last
    sound, and exactly ``margin_ms`` of digital silence is appended. The windows slide by one
    sample, so the cut does not depend on where the audio began (20 ms windows on a grid
    from its first sample moved it by up to 20 ms, and G.711 questions were heard
    differently live and in batch). So a turn committed after a 500 ms silence, its
    speculative transcription 96 ms into that silence and the same words sent to the batch
    route (which puts silence around a clip, duplex_server/http/codecs.py) give the decoder
    the same input. Audio with no sound is returned as it is.
    """
    win = max(1, sample_rate // 50)
    if audio.size == 0:
        return audio
    # the audio with a window of silence each side: a window may hear a first sound that
    # lies right at the audio's start from before it
    ext = np.concatenate([np.zeros(win), np.asarray(audio, dtype=np.float32), np.zeros(win)])
    rms = _centred_rms(ext, win)
    if float(rms.max()) <= EDGE_FLOOR:
        return audio
    loud = np.nonzero(rms > max(EDGE_REL * float(rms.max()), EDGE_FLOOR))[0]
    margin = int(sample_rate * margin_ms / 1000)
    start = max(win, int(loud[0]) - margin)  # (ext has ``win`` samples before the audio)
    end = min(win + audio.size, int(loud[-1]) + 1)
    return np.concatenate([ext[start:end], np.zeros(margin)]).astype(np.float32)


def _centred_rms(x: npt.NDArray[np.floating], win: int) -> npt.NDArray[np.float64]:
    """The RMS of the ``win``-sample window centred on each sample (zeros beyond the ends)."""
    half = win // 2
    padded = np.concatenate([np.zeros(half), x.astype(np.float64), np.zeros(win - half)])
    sums = np.concatenate([[0.0], np.cumsum(padded * padded)])
    power = np.maximum(sums[win:] - sums[:-win], 0.0)[: x.size] / win
    rms: npt.NDArray[np.float64] = np.sqrt(power)
    return rms


def lead_trim(audio: Float32Array, sample_rate: int, margin_ms: float = 5.0) -> Float32Array:
    """``audio`` without its leading silence: cut to ``margin_ms`` before the first audible
    window (:func:`first_audible`). Silent audio is returned as it is."""
    first = first_audible(audio, sample_rate)
    if first is None:
        return audio
    return audio[max(0, first - int(sample_rate * margin_ms / 1000)) :]


def quiet_level(head: bytes | bytearray) -> float:
    """The level under which audio after the PCM16 ``head`` counts as silence:
    ``TAIL_REL`` of the head's loudest 20 ms window (see :func:`quiet_after`)."""
    ref = _window_rms(pcm16_to_float32(head[: len(head) - len(head) % 2]), _QUIET_WIN)
    return max(TAIL_REL * float(ref.max()) if ref.size else 0.0, EDGE_FLOOR)


def quiet_after(pcm: bytes | bytearray, head_len: int, level: float | None = None) -> bool:
    """Is the PCM16 audio after the first ``head_len`` bytes silence, judged against the
    loudness of the head (``TAIL_REL`` of its loudest 20 ms window; ``level``: that level,
    from :func:`quiet_level`, when the caller already has it)?"""
    tail = pcm16_to_float32(pcm[head_len - head_len % 2 :])
    if tail.size == 0:
        return True
    if level is None:
        level = quiet_level(pcm[:head_len])
    win = _QUIET_WIN
    t = _window_rms(tail, win)
    if t.size == 0:
        t = np.sqrt(np.mean(tail * tail, keepdims=True))
    return bool(float(t.max()) <= level)


_QUIET_WIN = 320  # 20 ms at 16 kHz; the rule is coarse enough for any engine rate


def split_pcm(pcm: bytes, sample_rate: int, chunk_ms: float) -> list[bytes]:
    """Cut PCM16 mono into chunks of ``chunk_ms`` (the last one may be shorter)."""
    step = 2 * samples_for_ms(sample_rate, chunk_ms)
    return [pcm[i : i + step] for i in range(0, len(pcm), step)]


class PcmChunker:
    """Re-chunks a PCM16 stream into pieces of exactly ``chunk_ms`` (TTS output framing).

    ``push`` returns the full chunks available; ``flush`` returns the short remainder
    (call it at a sentence or stream end so no audio waits for the next sentence).
    """

    def __init__(self, sample_rate: int, chunk_ms: float) -> None:
        self._step = 2 * samples_for_ms(sample_rate, chunk_ms)
        self._buf = bytearray()

    def push(self, pcm: bytes) -> list[bytes]:
        self._buf += pcm
        n = len(self._buf) - len(self._buf) % self._step
        if n == 0:
            return []
        out = [bytes(self._buf[i : i + self._step]) for i in range(0, n, self._step)]
        del self._buf[:n]
        return out

    def flush(self) -> bytes:
        rest = bytes(self._buf)
        self._buf.clear()
        return rest
