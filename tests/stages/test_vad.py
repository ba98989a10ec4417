"""VAD: the segmenter state machine (pure) and Silero/energy detectors on real audio."""

from __future__ import annotations

import numpy as np
import pytest

from audio_kit.pcm import float32_to_pcm16, pcm16_to_float32
from audio_kit.vad import (
    CHUNK_MS,
    CHUNK_SAMPLES,
    EnergyVad,
    SileroVad,
    VadEvent,
    VadSegmenter,
    VadStream,
)


def _feed(seg: VadSegmenter, probs: list[float], chunk_ms: float = 32.0) -> list[VadEvent]:
    events = []
    for i, p in enumerate(probs):
        ev = seg.update(p, i * chunk_ms, (i + 1) * chunk_ms)
        if ev is not None:
            events.append(ev)
    end = seg.finish(len(probs) * chunk_ms)
    return events + ([end] if end is not None else [])


def test_segmenter_start_stop_with_padding() -> None:
    seg = VadSegmenter(
        threshold=0.5, min_speech_ms=64, silence_duration_ms=96, prefix_padding_ms=100
    )
    probs = [0.0] * 10 + [0.9] * 10 + [0.0] * 5
    started, stopped = _feed(seg, probs)
    assert started == VadEvent("speech_started", audio_ms=320 - 100, at_ms=384, onset_ms=320)
    assert stopped == VadEvent("speech_stopped", audio_ms=640, at_ms=736, onset_ms=640)
    assert not seg.speaking


def test_segmenter_ignores_blips_shorter_than_min_speech() -> None:
    seg = VadSegmenter(min_speech_ms=96, silence_duration_ms=96, prefix_padding_ms=0)
    assert _feed(seg, [0.0, 0.9, 0.9, 0.0, 0.9, 0.0, 0.0]) == []


def test_segmenter_hysteresis_keeps_speech_through_middling_probabilities() -> None:
    seg = VadSegmenter(threshold=0.5, min_speech_ms=32, silence_duration_ms=64)
    # 0.4 is between threshold-0.15 and threshold: neither speech nor silence.
    events = _feed(seg, [0.9, 0.4, 0.4, 0.4, 0.4, 0.9, 0.1, 0.1])
    assert [e.kind for e in events] == ["speech_started", "speech_stopped"]
    assert events[1].audio_ms == 6 * 32


def test_segmenter_short_pause_does_not_split() -> None:
    seg = VadSegmenter(min_speech_ms=32, silence_duration_ms=320, prefix_padding_ms=0)
    events = _feed(seg, [0.9] * 5 + [0.0] * 9 + [0.9] * 5 + [0.0] * 11)
    assert [e.kind for e in events] == ["speech_started", "speech_stopped"]


def test_segmenter_finish_closes_open_segment() -> None:
    seg = VadSegmenter(min_speech_ms=32, prefix_padding_ms=0)
    events = _feed(seg, [0.9] * 4)
    assert events[-1] == VadEvent("speech_stopped", audio_ms=128, at_ms=128, onset_ms=128)


def test_energy_vad_separates_silence_and_tone() -> None:
    vad = EnergyVad()
    t = np.arange(CHUNK_SAMPLES) / 16000
    assert vad.probability(np.zeros(CHUNK_SAMPLES, np.float32)) == 0.0
    assert vad.probability((0.3 * np.sin(2 * np.pi * 200 * t)).astype(np.float32)) == 1.0
    with pytest.raises(ValueError):
        vad.probability(np.zeros(100, np.float32))


def test_split_samples_cuts_the_same_windows_as_split(beckett: bytes) -> None:
    """The input lane hands the VAD the resampler's float32 samples (``split_samples``);
    they must cut the same 512-sample windows, in the same places, as the PCM16 path."""
    by_bytes, by_samples = (
        VadStream(EnergyVad(), VadSegmenter()),
        VadStream(EnergyVad(), VadSegmenter()),
    )
    pcm = beckett[: 16000 * 2 * 3]
    for i in range(0, len(pcm), 640):  # 20 ms pieces: windows straddle them
        a = by_bytes.split(pcm[i : i + 640])
        b = by_samples.split_samples(pcm16_to_float32(pcm[i : i + 640]))
        assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    odd = VadStream(EnergyVad(), VadSegmenter())
    odd.split(b"\x00\x00\x00")  # half a sample carried: the float path cannot take over
    with pytest.raises(ValueError):
        odd.split_samples(np.zeros(320, np.float32))


def _segments(stream: VadStream, pcm: bytes, piece: int) -> list[tuple[float, float]]:
    events: list[VadEvent] = []
    for i in range(0, len(pcm), piece):
        events += stream.feed(pcm[i : i + piece])
    end = stream.finish()
    if end is not None:
        events.append(end)
    assert [e.kind for e in events] == ["speech_started", "speech_stopped"] * (len(events) // 2)
    return [(a.audio_ms, b.audio_ms) for a, b in zip(events[::2], events[1::2], strict=True)]


@pytest.mark.models
def test_silero_finds_the_six_phrases_of_beckett(beckett: bytes) -> None:
    seg = VadSegmenter(threshold=0.5, silence_duration_ms=320, prefix_padding_ms=0)
    stream = VadStream(SileroVad(), seg)
    segments = _segments(stream, beckett, 641)  # odd piece size: exercises the carry
    # "Ever tried. / Ever failed. / No matter. / Try again. / Fail again. / Fail better."
    assert len(segments) == 6, segments
    total = len(beckett) / 32
    for start, stop in segments:
        assert 0 <= start < stop <= total
        assert 300 <= stop - start <= 1600
    assert segments[0][0] < 600  # speech starts ~0.35 s into the file
    # Same audio again after reset: same segments (state fully reset).
    stream.reset()
    assert _segments(stream, beckett, 4096) == segments


@pytest.mark.models
def test_silero_is_quiet_on_silence_and_noise() -> None:
    vad = SileroVad()
    rng = np.random.default_rng(0)
    noise = (rng.standard_normal(16000) * 0.005).astype(np.float32)
    stream = VadStream(vad, VadSegmenter())
    assert stream.feed(float32_to_pcm16(np.zeros(16000, np.float32))) == []
    assert stream.feed(float32_to_pcm16(noise)) == []
    assert stream.position_ms == pytest.approx(2000 - 2000 % CHUNK_MS, abs=CHUNK_MS)


@pytest.mark.models
def test_silero_detects_synthesized_speech(piper_question: bytes) -> None:
    pad = bytes(16000)  # 0.5 s of silence on each side
    stream = VadStream(SileroVad(), VadSegmenter(prefix_padding_ms=0))
    segments = _segments(stream, pad + piper_question + pad, 1024)
    assert len(segments) == 1
    start, stop = segments[0]
    assert 400 <= start <= 800
    assert stop - start >= 0.7 * len(piper_question) / 32


def test_segmenter_pause_and_resume_inside_speech() -> None:
    from audio_kit.vad import VadSegmenter

    seg = VadSegmenter(threshold=0.5, min_speech_ms=64, silence_duration_ms=500, pause_ms=96)
    events = []
    t = 0.0
    for p in [0.9] * 5 + [0.0] * 4 + [0.9] * 2 + [0.0] * 20:  # speech, short gap, speech, end
        ev = seg.update(p, t, t + 32)
        if ev is not None:
            events.append((ev.kind, ev.audio_ms))
        t += 32
    assert [k for k, _ in events] == [
        "speech_started",
        "pause",
        "resume",
        "pause",
        "speech_stopped",
    ]
    assert events[1][1] == 160.0  # the pause is dated where the silence began


def test_segmenter_pauses_sooner_inside_a_short_turn() -> None:
    """``short_pause_ms``: while the speech so far is under ``short_turn_ms`` a pause fires
    after the shorter silence; later in a long turn, after ``pause_ms``."""
    from audio_kit.vad import VadSegmenter

    def pauses(speech_chunks: int) -> list[tuple[str, float, float]]:
        seg = VadSegmenter(
            threshold=0.5,
            min_speech_ms=64,
            silence_duration_ms=500,
            pause_ms=96,
            short_pause_ms=64,
            short_turn_ms=1000,
        )
        out = []
        t = 0.0
        for p in [0.9] * speech_chunks + [0.0] * 20:
            ev = seg.update(p, t, t + 32)
            if ev is not None:
                out.append((ev.kind, ev.audio_ms, ev.at_ms))
            t += 32
        return out

    short = pauses(10)  # 320 ms of speech
    assert [k for k, *_ in short] == ["speech_started", "pause", "speech_stopped"]
    assert short[1][2] - short[1][1] == 64.0  # two chunks of silence
    long = pauses(40)  # 1,280 ms of speech: over short_turn_ms
    assert [k for k, *_ in long] == ["speech_started", "pause", "speech_stopped"]
    assert long[1][2] - long[1][1] == 96.0  # three chunks


@pytest.mark.models
def test_batched_silero_scores_like_one_stream_at_a_time(beckett: bytes) -> None:
    """Three streams at different offsets of a real recording: one onnxruntime call per
    round gives each stream the probabilities it gets alone, and the same speech events."""
    from audio_kit.vad import probabilities

    offsets = [0, 5000, 17000]  # samples: the streams are out of phase
    alone, together = [], []
    for off in offsets:
        stream = VadStream(SileroVad(), VadSegmenter(prefix_padding_ms=0))
        chunks = stream.split(beckett[2 * off :])
        alone.append([stream.detector.probability(c) for c in chunks])
    streams = [VadStream(SileroVad(), VadSegmenter(prefix_padding_ms=0)) for _ in offsets]
    energy = VadStream(EnergyVad(), VadSegmenter())
    pieces = [s.split(beckett[2 * off :]) for s, off in zip(streams, offsets, strict=True)]
    # uneven work: each stream's chunks in two entries of the batch, plus a non-Silero stream
    work: list[tuple[object, list[np.ndarray]]] = []
    for s, p in zip(streams, pieces, strict=True):
        work += [(s.detector, p[:40]), (s.detector, p[40:])]
    work.append((energy.detector, energy.split(beckett[:32000])))
    scores = probabilities(work)  # type: ignore[arg-type]
    for k in range(len(offsets)):
        together.append(scores[2 * k] + scores[2 * k + 1])
        np.testing.assert_allclose(together[k], alone[k], atol=1e-5)
    assert len(scores[-1]) == 16000 // CHUNK_SAMPLES  # 32000 bytes = 16000 samples
    # same segments: the streams keep their own state across batched rounds
    for s, probs, chunks in zip(streams, together, pieces, strict=True):
        events = [e for p, c in zip(probs, chunks, strict=True) for e in s.observe(p, c)]
        assert [e.kind for e in events][:2] == ["speech_started", "speech_stopped"]


@pytest.mark.models
def test_silero_streams_share_one_model_session() -> None:
    a, b = SileroVad(), SileroVad()
    assert a.session is b.session
    chunk = np.zeros(CHUNK_SAMPLES, np.float32)
    a.probability(chunk)
    assert not np.array_equal(a.state, b.state)  # state is per stream


def _stop_after(verdict: float | None, speech_chunks: int = 20) -> float | None:
    """Silence (ms) after which a turn stops when the semantic verdict at its 192 ms pause
    is ``verdict`` (VadStream.end_of_turn); None if it never stops within 3 s."""
    seg = VadSegmenter(threshold=0.5, min_speech_ms=64, silence_duration_ms=1500, pause_ms=192)
    stream = VadStream(EnergyVad(), seg, lambda audio: verdict, 400.0, 480.0)
    chunk = np.zeros(CHUNK_SAMPLES, dtype=np.float32)
    for _ in range(speech_chunks):
        stream.observe(0.9, chunk)
    silence_from = stream.position_ms
    for _ in range(int(3000 / CHUNK_MS)):
        for ev in stream.observe(0.0, chunk):
            if ev.kind == "speech_stopped":
                assert ev.audio_ms == silence_from
                return stream.position_ms - silence_from
    return None


def test_a_semantic_verdict_sets_how_long_this_pause_may_last() -> None:
    """Finished (0): the turn ends at the pause; probably finished (a wait): after that
    much silence; unfinished (None): after silence_duration_ms; a turn too short to judge:
    after short_turn_wait_ms."""
    assert _stop_after(0.0) == 192.0
    assert _stop_after(500.0) == 512.0
    assert _stop_after(None) == 1504.0
    assert _stop_after(0.0, speech_chunks=5) == 480.0  # 160 ms of speech: not judged


def test_speech_after_a_pause_clears_the_verdict() -> None:
    seg = VadSegmenter(threshold=0.5, min_speech_ms=64, silence_duration_ms=1500, pause_ms=192)
    verdicts = iter([None, 480.0])  # the first pause sounds unfinished, the second not
    stream = VadStream(EnergyVad(), seg, lambda audio: next(verdicts), 0.0)
    chunk = np.zeros(CHUNK_SAMPLES, dtype=np.float32)
    kinds = []
    for p in [0.9] * 10 + [0.0] * 20 + [0.9] * 10 + [0.0] * 30:  # 640 ms pause, speech, end
        kinds += [(ev.kind, stream.position_ms) for ev in stream.observe(p, chunk)]
    assert [k for k, _ in kinds] == ["speech_started", "pause", "resume", "pause", "speech_stopped"]
    assert kinds[-1][1] - 40 * CHUNK_MS == 480.0  # the second verdict, not the first
