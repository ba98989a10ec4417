"""Audio encoding and decoding for the HTTP batch path. Real codecs only.

* wav / flac / opus (Ogg): libsndfile through ``soundfile`` (libsndfile >= 1.0.29 writes
  Ogg/Opus; opus accepts 8, 12, 16, 24 or 48 kHz, so other rates are resampled to 48 kHz).
* mp3: LAME through ``lameenc`` (incremental: every ``feed`` returns whole MP3 frames).
* pcm: raw PCM16 little-endian mono, unchanged.

:class:`StreamEncoder` turns PCM16 chunks into encoded bytes as they arrive (``feed``) and
ends the stream (``finish``), so ``stream_format: audio`` can send a playable container
before the whole answer exists. libsndfile writes containers into a :class:`_Sink` that
hands out bytes once written. A streamed WAV gets the usual streaming marker (RIFF and data
sizes 0xFFFFFFFF), as OpenAI's own streamed WAV does. FLAC is the exception: a FLAC stream
of unknown length is valid, but libsndfile 1.2.2 (what ``soundfile`` readers use) cannot
read one, so a "streamed" FLAC is written in one piece by ``finish`` with its exact
STREAMINFO. :func:`encode_audio` encodes a whole clip (exact headers).

:func:`decode_audio` reads an uploaded file (WAV, FLAC, Ogg/Vorbis/Opus, MP3 - whatever
libsndfile reads), mixes to mono and resamples with ``soxr`` to the engine rate.
"""

from __future__ import annotations

import io
import struct
from typing import Literal

import lameenc
import numpy as np
import soundfile
import soxr

from audio_kit.fir import FirResampler, fir_ratio
from audio_kit.pcm import float32_to_pcm16, resample, upsample2x_pcm16

#: silence (s) put around an uploaded clip: more than the ASR's edge margin (0.15 s)
_EDGE_PAD_S = 0.2
SpeechFormat = Literal["wav", "pcm", "flac", "mp3", "opus"]
SPEECH_FORMATS: tuple[SpeechFormat, ...] = ("wav", "pcm", "flac", "mp3", "opus")
CONTENT_TYPES: dict[SpeechFormat, str] = {
    "wav": "audio/wav",
    "pcm": "audio/pcm",
    "flac": "audio/flac",
    "mp3": "audio/mpeg",
    "opus": "audio/ogg; codecs=opus",
}
_SNDFILE: dict[str, tuple[str, str]] = {
    "wav": ("WAV", "PCM_16"),
    "flac": ("FLAC", "PCM_16"),
    "opus": ("OGG", "OPUS"),
}
_OPUS_RATES = (8000, 12000, 16000, 24000, 48000)
_STREAM_SIZE = 0xFFFFFFFF


#: what the decoder reads, for error messages
READABLE = "send WAV, FLAC, MP3 or Ogg (Vorbis, Opus) audio"


class AudioDecodeError(ValueError):
    """The uploaded bytes are not audio that libsndfile can read."""


class _Sink(io.RawIOBase):
    """A seekable file for libsndfile whose written prefix can be taken out as it grows."""

    def __init__(self) -> None:
        super().__init__()
        self._buf = bytearray()
        self._pos = 0
        self._sent = 0  # bytes already handed out (changes to them are dropped)

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._buf)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, b: memoryview) -> int:  # type: ignore[override]
        data = self._buf[self._pos : self._pos + len(b)]
        b[: len(data)] = data
        self._pos += len(data)
        return len(data)

    def write(self, b: bytes | bytearray | memoryview) -> int:  # type: ignore[override]
        data = bytes(b)
        end = self._pos + len(data)
        if end > len(self._buf):
            self._buf.extend(b"\0" * (end - len(self._buf)))
        self._buf[self._pos : end] = data
        self._pos = end
        return len(data)

    def take(self) -> bytes:
        out = bytes(self._buf[self._sent :])
        self._sent = len(self._buf)
        return out


def _as_float(pcm: bytes) -> np.ndarray:
    return np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0


class StreamEncoder:
    """PCM16 mono chunks in, encoded bytes out, incrementally."""

    def __init__(self, fmt: SpeechFormat, sample_rate: int) -> None:
        self.fmt = fmt
        self.in_rate = sample_rate
        self._lame: lameenc.Encoder | None = None
        self._sf: soundfile.SoundFile | None = None
        self._sink: _Sink | None = None
        self._resampler: soxr.ResampleStream | None = None
        self._first = True
        if fmt == "mp3":
            self._lame = lameenc.Encoder()
            self._lame.set_bit_rate(64)
            self._lame.set_in_sample_rate(sample_rate)
            self._lame.set_channels(1)
            self._lame.set_quality(5)
        elif fmt != "pcm":
            container, subtype = _SNDFILE[fmt]
            rate = sample_rate
            if fmt == "opus" and rate not in _OPUS_RATES:
                rate = 48000
                self._resampler = soxr.ResampleStream(sample_rate, rate, 1, dtype="float32")
            self._sink = _Sink()
            self._sf = soundfile.SoundFile(
                self._sink, "w", samplerate=rate, channels=1, format=container, subtype=subtype
            )

    def feed(self, pcm: bytes) -> bytes:
        if self.fmt == "pcm":
            return pcm
        if self._lame is not None:
            return bytes(self._lame.encode(pcm))
        assert self._sf is not None
        samples = _as_float(pcm)
        if self._resampler is not None:
            samples = self._resampler.resample_chunk(samples)
        if samples.size:
            self._sf.write(samples)
        return b"" if self.fmt == "flac" else self._take()

    def finish(self) -> bytes:
        if self._lame is not None:
            return bytes(self._lame.flush())
        if self._sf is None:
            return b""
        if self._resampler is not None:
            tail = self._resampler.resample_chunk(np.zeros(0, np.float32), last=True)
            if tail.size:
                self._sf.write(tail)
        self._sf.close()
        return self._take()

    def _take(self) -> bytes:
        assert self._sink is not None
        data = self._sink.take()
        if self._first and data:
            self._first = False
            if self.fmt == "wav":
                data = _wav_stream_marker(data)
        return data


def _wav_stream_marker(header: bytes) -> bytes:
    """Mark a WAV header written before the length was known as a stream (sizes 0xFFFFFFFF)."""
    pos = header.find(b"data")
    if not header.startswith(b"RIFF") or pos < 0 or pos + 8 > len(header):
        return header
    out = bytearray(header)
    struct.pack_into("<I", out, 4, _STREAM_SIZE)
    struct.pack_into("<I", out, pos + 4, _STREAM_SIZE)
    return bytes(out)


def encode_audio(pcm: bytes, sample_rate: int, fmt: SpeechFormat) -> bytes:
    """Encode a whole PCM16 mono clip; headers carry the exact length."""
    if fmt == "pcm":
        return pcm
    if fmt == "mp3":
        enc = StreamEncoder("mp3", sample_rate)
        return enc.feed(pcm) + enc.finish()
    container, subtype = _SNDFILE[fmt]
    samples = _as_float(pcm)
    rate = sample_rate
    if fmt == "opus" and rate not in _OPUS_RATES:
        samples = soxr.resample(samples, rate, 48000)
        rate = 48000
    buf = io.BytesIO()
    soundfile.write(buf, samples, rate, format=container, subtype=subtype)
    return buf.getvalue()


def decode_audio(data: bytes, target_rate: int) -> tuple[bytes, float]:
    """Decode an audio file to PCM16 mono at ``target_rate``; returns (pcm, duration_s)."""
    try:
        samples, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except soundfile.LibsndfileError as exc:
        # str(exc) names the file object ("Error opening <_io.BytesIO object at 0x...>")
        reason = exc.error_string.strip().rstrip(".") or "unreadable data"
        raise AudioDecodeError(f"cannot decode audio ({reason}); {READABLE}") from None
    except (RuntimeError, TypeError):
        raise AudioDecodeError(f"cannot decode audio; {READABLE}") from None
    mono = samples.mean(axis=1) if samples.shape[1] > 1 else samples[:, 0]
    duration = mono.shape[0] / rate if rate else 0.0
    # silence around the clip, as a live session hears words: a file that starts or ends on
    # a word then gets the resampler's edges and the ASR's margins (audio_kit.pcm.edge_trim)
    # a live turn gets, so both give Whisper the same samples (within 1 LSB), not a clip
    # 150 ms shorter (G.711 questions were heard differently live and in batch)
    pad = np.zeros(int(rate * _EDGE_PAD_S), dtype=np.float32)
    mono = np.concatenate([pad, mono.astype(np.float32), pad])
    if rate == 8000 and target_rate == 16000:  # as a live session's input (audio_kit.pcm)
        return upsample2x_pcm16(float32_to_pcm16(mono)), duration
    if fir_ratio(rate, target_rate):  # 24, 48 kHz: as a live session's input, too
        return FirResampler(rate, target_rate).process(float32_to_pcm16(mono)), duration
    if rate != target_rate:
        mono = resample(mono, rate, target_rate)
    # rounded as the live input path rounds (a 16 kHz PCM16 upload keeps its samples)
    return float32_to_pcm16(mono), duration
