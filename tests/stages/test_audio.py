"""PCM helpers and soxr resampling (pure, no models)."""

from __future__ import annotations

import numpy as np
import pytest
import soxr

from audio_kit.fir import FirResampler
from audio_kit.pcm import (
    QUALITY,
    PcmChunker,
    StreamResampler,
    Upsampler2x,
    edge_trim,
    float32_to_pcm16,
    input_resampler,
    lead_trim,
    pcm16_to_float32,
    quiet_after,
    resample,
    resample_pcm16,
    split_pcm,
    upsample2x_pcm16,
)
from duplex_contract.audible import AudibleStart, first_audible


def _tone(rate: int, seconds: float, hz: float = 440.0) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return (0.5 * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def test_pcm16_float32_round_trip() -> None:
    pcm = np.array([0, 1, -1, 32767, -32768, 1234], dtype="<i2").tobytes()
    assert float32_to_pcm16(pcm16_to_float32(pcm)) == pcm
    assert pcm16_to_float32(pcm).dtype == np.float32


def test_float_to_pcm16_clips() -> None:
    out = np.frombuffer(float32_to_pcm16(np.array([2.0, -2.0], dtype=np.float32)), "<i2")
    assert out.tolist() == [32767, -32768]


def test_odd_length_pcm_is_refused() -> None:
    with pytest.raises(ValueError):
        pcm16_to_float32(b"\x00")


@pytest.mark.parametrize(("src", "dst"), [(22050, 24000), (24000, 16000), (16000, 48000)])
def test_resample_keeps_length_and_pitch(src: int, dst: int) -> None:
    tone = _tone(src, 1.0)
    out = resample(tone, src, dst)
    assert abs(len(out) - dst) <= 1
    spectrum = np.abs(np.fft.rfft(out[dst // 10 : dst // 10 + dst // 2]))
    peak_hz = np.argmax(spectrum) * dst / (dst // 2)
    assert abs(peak_hz - 440.0) < 5.0


def test_resample_pcm16_same_rate_is_identity() -> None:
    pcm = float32_to_pcm16(_tone(16000, 0.1))
    assert resample_pcm16(pcm, 16000, 16000) is pcm


def test_stream_resampler_matches_one_shot() -> None:
    pcm = float32_to_pcm16(_tone(24000, 1.0))
    stream = StreamResampler(24000, 16000)
    pieces = [stream.process(pcm[i : i + 961]) for i in range(0, len(pcm), 961)]  # odd sizes
    streamed = b"".join(pieces) + stream.flush()
    one_shot = resample_pcm16(pcm, 24000, 16000)
    assert abs(len(streamed) - len(one_shot)) <= 4
    n = min(len(streamed), len(one_shot)) // 2
    a = np.frombuffer(streamed, "<i2")[:n].astype(np.float64)
    b = np.frombuffer(one_shot, "<i2")[:n].astype(np.float64)
    assert np.max(np.abs(a - b)) <= 64  # same filter; only rounding at chunk borders


@pytest.mark.parametrize("rate", [24000, 8000])
def test_stream_resampler_output_does_not_depend_on_the_cut_or_the_run(rate: int) -> None:
    """The same stream cut into appends of 10, 20, 40, 100, 200 ms (or odd sizes) resamples
    to the same bytes, run after run. soxr's int16 output adds random dither: the live
    transcript of a recording then changed with the append size ("Fail better" as "Failed
    better" with 100 ms appends at 24 kHz, "Ever failed" as "Everfile" with u-law)."""
    rng = np.random.default_rng(7)
    tone = _tone(rate, 2.0) + rng.normal(0, 0.05, 2 * rate).astype(np.float32)
    pcm = float32_to_pcm16(tone)

    def cut(step: int) -> bytes:
        stream = StreamResampler(rate, 16000)
        return b"".join(stream.process(pcm[i : i + step]) for i in range(0, len(pcm), step)) + (
            stream.flush()
        )

    ref = cut(2 * rate // 50)  # 20 ms
    for ms in (10, 40, 100, 200):
        assert cut(2 * rate * ms // 1000) == ref, ms
    assert cut(2 * rate // 50) == ref  # and again
    assert cut(961) == ref  # odd sizes


def test_stream_resampler_gives_the_scaled_streams_bytes_and_their_samples() -> None:
    """``process_samples`` runs soxr on unscaled int16 values (two array passes fewer a
    call): its bytes are bit for bit a float32 stream over [-1, 1) rounded to int16, clipped
    overshoot and the flushed tail included, and its samples are exactly those bytes as
    float32 (what the VAD then scores)."""
    rng = np.random.default_rng(3)
    loud = np.clip(rng.normal(0, 0.6, 48000), -1, 1).astype(np.float32)  # overshoots
    pcm = float32_to_pcm16(np.concatenate([loud, _tone(24000, 1.0)]))
    ref = soxr.ResampleStream(24000, 16000, 1, dtype="float32", quality=QUALITY)
    stream = StreamResampler(24000, 16000)
    clipped, carry = 0, b""
    for i in range(0, len(pcm), 961):  # odd sizes: a byte carried between calls
        got, samples = stream.process_samples(pcm[i : i + 961])
        data = carry + pcm[i : i + 961]
        whole = len(data) // 2 * 2
        data, carry = data[:whole], data[whole:]
        assert got == float32_to_pcm16(ref.resample_chunk(pcm16_to_float32(data))), i
        assert np.array_equal(samples, pcm16_to_float32(got))
        clipped += int(np.sum(np.abs(samples) >= 32767 / 32768))
    assert clipped > 0  # the clip path ran
    assert stream.flush() == float32_to_pcm16(ref.resample_chunk(np.zeros(0, np.float32), True))


def test_8k_input_is_brought_to_16k_at_once_the_same_however_it_is_cut() -> None:
    """A session's 8 kHz input (G.711, Twilio) becomes 16 kHz with no delay and no blocks:
    each piece gives two samples per input sample at once (soxr HQ gives nothing for the
    first ~50 ms and then ~100 ms blocks), the midpoint with the sample before and the
    sample itself; the output does not depend on where the stream was cut (odd bytes
    carried), equals the whole buffer's (the batch route's), and the samples are the bytes
    as float32. 24 and 48 kHz have a FIR filter (below), others keep soxr."""
    rng = np.random.default_rng(5)
    x = np.clip(rng.normal(0, 8000, 8000), -32768, 32767).astype("<i2")
    pcm = x.tobytes()
    whole = upsample2x_pcm16(pcm)
    assert len(whole) == 2 * len(pcm)
    y = np.frombuffer(whole, "<i2").astype(np.int32)
    assert np.array_equal(y[1::2], x)  # the input samples, where they were
    prev = np.concatenate(([0], x[:-1].astype(np.int32)))
    assert np.array_equal(y[0::2], (prev + x.astype(np.int32)) // 2)  # the midpoints
    up = input_resampler(8000, 16000)
    assert isinstance(up, Upsampler2x) and not up.passthrough
    parts, n = [], 0
    for i in range(0, len(pcm), 161):  # odd sizes: a byte carried between calls
        got, samples = up.process_samples(pcm[i : i + 161])
        assert np.array_equal(samples, pcm16_to_float32(got))
        n += len(pcm[i : i + 161])
        assert len(b"".join(parts)) + len(got) == 2 * (n // 2 * 2)  # nothing held back
        parts.append(got)
    assert b"".join(parts) == whole and up.flush() == b""
    assert up.process(pcm[:320]) == whole[:640]  # flushed: a new stream
    assert isinstance(input_resampler(24000, 16000), FirResampler)
    assert isinstance(input_resampler(48000, 16000), FirResampler)
    assert isinstance(input_resampler(44100, 16000), StreamResampler)  # 160/441: soxr
    assert isinstance(input_resampler(16000, 16000), StreamResampler)
    soxr_first = StreamResampler(8000, 16000).process(pcm[:320])  # 20 ms in
    assert soxr_first == b""  # why: soxr holds the first 20 ms back entirely


def _gain_db(x: np.ndarray, rate: int, out_rate: int, hz: float) -> float:
    t = np.arange(rate) / rate
    tone = np.rint(16000 * np.sin(2 * np.pi * hz * t)).astype("<i2").tobytes()
    y = np.frombuffer(FirResampler(rate, out_rate).process(tone), "<i2").astype(np.float64)
    y = y[out_rate // 10 :]  # past the filter's start
    return float(20 * np.log10(np.sqrt(np.mean(y**2)) / (16000 / np.sqrt(2))))


@pytest.mark.parametrize("rate", [24000, 48000])
def test_24k_and_48k_input_is_brought_to_16k_at_once_the_same_however_it_is_cut(
    rate: int,
) -> None:
    """A session's 24 kHz input (OpenAI's default) and a WebRTC call's 48 kHz become 16 kHz
    with nothing held back: each 20 ms in gives 20 ms out at once (soxr's stream resampler
    gave nothing for the first frame and then blocks, holding ~22 ms on average, up to ~37),
    the filter's delay 1.25 ms; the same bytes however the stream is cut (odd bytes
    carried) and run after run; speech passes as soxr passes it; what would fold back into
    the speech band is 65 dB down."""
    rng = np.random.default_rng(11)
    x = np.clip(rng.normal(0, 6000, 2 * rate), -32768, 32767).astype("<i2").tobytes()
    frame = rate // 50 * 2  # 20 ms

    def cut(step: int) -> bytes:
        fir = FirResampler(rate, 16000)
        return b"".join(fir.process(x[i : i + step]) for i in range(0, len(x), step))

    ref = cut(frame)
    for step in (frame // 2, 2 * frame, 5 * frame, 961, 7):
        assert cut(step) == ref, step
    assert cut(frame) == ref  # and again
    fir = input_resampler(rate, 16000)
    assert isinstance(fir, FirResampler)
    soxr_stream = StreamResampler(rate, 16000)
    for i in range(0, len(x), frame):
        got, samples = fir.process_samples(x[i : i + frame])
        assert len(got) == 640 and not fir.holds  # 20 ms out for each 20 ms in
        assert np.array_equal(samples, pcm16_to_float32(got))
    assert fir.flush() == b""
    out = 0
    held = []
    for i in range(0, len(x), frame):
        out += len(soxr_stream.process(x[i : i + frame])) // 2
        held.append((i + frame) // 2 * 16000 // rate - out)
    assert np.mean(held[5:]) > 16 * 15  # soxr holds > 15 ms on average (why)
    # an impulse comes out 1.25 ms after where it went in, whole samples later
    imp = np.zeros(rate, "<i2")
    imp[rate // 2] = 30000
    y = np.frombuffer(FirResampler(rate, 16000).process(imp.tobytes()), "<i2")
    assert int(np.argmax(y)) - 8000 == fir.delay <= 20  # 1.25 ms
    # speech band flat, the fold-back band gone
    for hz in (300.0, 1000.0, 3000.0, 7200.0):
        assert abs(_gain_db(x, rate, 16000, hz)) < 0.05, hz
    for hz in (8800.0, 10000.0, 11000.0):
        assert _gain_db(x, rate, 16000, hz) < -60.0, hz
    # a recording as soxr HQ brings it (the batch route's resampler before): ~the same
    speech = _tone(rate, 1.0, 440.0) + 0.2 * _tone(rate, 1.0, 2500.0)
    pcm = float32_to_pcm16(speech)
    a = np.frombuffer(FirResampler(rate, 16000).process(pcm), "<i2").astype(np.float64)
    b = np.frombuffer(resample_pcm16(pcm, rate, 16000), "<i2").astype(np.float64)
    lag = fir.delay  # (soxr's output is aligned: its delay is held back)
    err = a[lag + 800 : 15000] - b[800 : 15000 - lag]
    assert np.sqrt(np.mean(err**2)) < 0.01 * np.sqrt(np.mean(b**2))


@pytest.mark.parametrize(
    "rates",
    [(24000, 16000), (48000, 16000), (32000, 16000), (16000, 8000), (16000, 24000), (16000, 48000)],
)
def test_fir_resampler_gives_the_textbook_polyphase_output(rates: tuple[int, int]) -> None:
    """Each output sample is the filter's definition, computed the slow way: the input
    zero-stuffed by ``up``, convolved with the taps, every ``down``-th sample kept, rounded
    and clipped. Loud input clips; the stream cut at random (odd bytes included) gives the
    same bytes as one call."""
    rate, out_rate = rates
    fir = FirResampler(rate, out_rate)
    rng = np.random.default_rng(5)
    x = np.clip(rng.normal(0, 14000, rate // 2), -32768, 32767).astype("<i2")
    x[1000:3000] = np.where(np.arange(2000) % 100 < 50, 32767, -32768)  # overshoots: clips
    stuffed = np.zeros(x.size * fir.up)
    stuffed[:: fir.up] = x
    full = np.convolve(stuffed, fir.taps_units)[: x.size * fir.up : fir.down] / 2**20
    want = np.clip(np.rint(full), -32768, 32767).astype("<i2")
    data = x.tobytes()
    parts, i = [], 0
    while i < len(data):
        step = int(rng.integers(0, 700))
        parts.append(fir.process(data[i : i + step]))
        i += step
    got = np.frombuffer(b"".join(parts), "<i2")
    assert got.size == want.size
    assert np.array_equal(got, want)
    assert np.any(np.abs(got) == 32767) or np.any(got == -32768)  # (it clipped)


def test_stream_resampler_passthrough_keeps_odd_byte() -> None:
    stream = StreamResampler(16000, 16000)
    assert stream.passthrough
    assert stream.process(b"\x01\x02\x03") == b"\x01\x02"
    assert stream.process(b"\x04") == b"\x03\x04"


def test_chunker_and_split() -> None:
    pcm = bytes(2 * 2500)  # 2500 samples at 24 kHz = 104 ms
    chunker = PcmChunker(24000, 20.0)
    out = chunker.push(pcm)
    assert [len(c) for c in out] == [960] * 5
    assert len(chunker.flush()) == 2 * 100
    assert chunker.flush() == b""
    assert [len(c) for c in split_pcm(pcm, 24000, 50.0)] == [2400, 2400, 200]


def test_edge_trim_makes_the_cut_point_irrelevant() -> None:
    """The same words cut 96 ms or 500 ms into the trailing silence (or sent with a
    second of silence around them) give the ASR the same samples."""
    rate = 16000
    speech = _tone(rate, 0.8)
    pad = np.zeros(rate, dtype=np.float32)
    a = edge_trim(np.concatenate([pad[:4800], speech, pad[:1536]]), rate, 150)
    b = edge_trim(np.concatenate([pad[:4800], speech, pad[:8000]]), rate, 150)
    c = edge_trim(np.concatenate([pad, speech, pad]), rate, 150)
    assert np.array_equal(a, b) and np.array_equal(b, c)
    assert a.size == pytest.approx(speech.size + 2 * 2400, abs=2 * 320)
    assert np.all(a[-2400:] == 0)
    silent = np.zeros(rate, dtype=np.float32)
    assert edge_trim(silent, rate, 150) is silent  # nothing to anchor on: untouched


def test_edge_trim_does_not_depend_on_where_the_audio_begins() -> None:
    """A live turn starts wherever the VAD's prefix padding reaches back to (any sample):
    the ASR gets the same samples. With 20 ms windows on a grid from the first sample the
    cut moved by up to 20 ms (G.711 questions were transcribed differently live and in
    batch)."""
    rate = 16000
    speech = _tone(rate, 0.5)
    speech[:37] = 0.0  # sound that begins and ends off any 20 ms grid
    speech[-53:] = 0.0
    pad = np.zeros(rate, dtype=np.float32)
    cuts = [
        edge_trim(np.concatenate([pad[:lead], speech, pad[:100]]), rate, 150)
        for lead in (3200, 3201, 3361, 4801, 7777)
    ]
    for other in cuts[1:]:
        assert np.array_equal(cuts[0], other)
    assert np.all(cuts[0][: 2400 + 37 - 170] == 0) and np.all(cuts[0][-2400 - 53 + 170 :] == 0)


def test_quiet_after_tells_silence_from_a_soft_word() -> None:
    loud = float32_to_pcm16(_tone(16000, 0.5))
    soft = float32_to_pcm16(_tone(16000, 0.2) * 0.1)  # -20 dB: a soft word
    noise = float32_to_pcm16(np.random.default_rng(1).normal(0, 0.001, 8000))  # -51 dB
    assert quiet_after(loud + bytes(8000), len(loud))
    assert quiet_after(loud + noise, len(loud))
    assert not quiet_after(loud + bytes(3200) + soft, len(loud))
    assert quiet_after(loud, len(loud))


def test_first_audible_finds_the_end_of_a_known_leading_silence() -> None:
    """A tone after 73 ms of silence (and -60 dBFS noise): the first 5 ms window at -40 dBFS
    starts within a window of 73 ms; quieter audio is never audible."""
    rate = 24000
    rng = np.random.default_rng(0)
    lead = (rng.standard_normal(int(rate * 0.073)) * 1e-3).astype(np.float32)  # -60 dBFS
    audio = np.concatenate([lead, _tone(rate, 0.2)])
    at = first_audible(audio, rate)
    assert at is not None and abs(at - lead.size) <= rate * 0.005
    assert first_audible(lead, rate) is None
    trimmed = lead_trim(audio, rate)
    assert first_audible(trimmed, rate) is not None
    assert first_audible(trimmed, rate) <= rate * 0.01
    assert lead_trim(lead, rate) is lead


def test_audible_start_is_when_a_player_reaches_the_first_audible_sample() -> None:
    """Pieces of 100 ms at 24 kHz: two silent, then the tone 20 ms into the third. Arriving
    in time, it is heard 220 ms after the first byte; arriving late, when it arrives."""
    rate = 24000
    silent = bytes(2 * 2400)
    loud = float32_to_pcm16(np.concatenate([np.zeros(480, np.float32), _tone(rate, 0.08)]))
    on_time = AudibleStart()
    for t, piece in ((10.0, silent), (10.01, silent), (10.02, loud)):
        on_time.feed(t, piece, rate)
    assert on_time.first_byte_at == 10.0 and on_time.at == pytest.approx(10.22)
    late = AudibleStart()
    for t, piece in ((10.0, silent), (10.01, silent), (10.5, loud)):
        late.feed(t, piece, rate)
    assert late.at == pytest.approx(10.5)
