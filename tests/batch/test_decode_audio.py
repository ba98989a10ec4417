"""An uploaded clip, decoded for the ASR, is the audio a live session would give it: its
samples kept, silence around it, resampled as the live stream resampler does (pure: no
server)."""

from __future__ import annotations

import io

import numpy as np
import soundfile

from audio_kit.pcm import input_resampler
from duplex_server.http.codecs import decode_audio


def _wav(samples: np.ndarray, rate: int) -> bytes:
    buf = io.BytesIO()
    soundfile.write(buf, samples, rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def _speech(rate: int, seconds: float) -> np.ndarray:
    """A clip that starts and ends on sound (as eSpeak NG's questions do)."""
    t = np.arange(int(rate * seconds)) / rate
    wave = 0.4 * np.sin(2 * np.pi * 220 * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t))
    return (wave * 32767).astype("<i2")


def test_a_16k_clip_keeps_its_samples_with_silence_around_them() -> None:
    """PCM16 samples come back as they were (rounded, not scaled by 32767 and truncated,
    which moved every sample of an upload by up to 1 LSB), with 0.2 s of silence around."""
    clip = _speech(16000, 0.5)
    pcm, duration = decode_audio(_wav(clip, 16000), 16000)
    out = np.frombuffer(pcm, "<i2")
    assert duration == 0.5
    assert out.size == clip.size + 2 * 3200
    assert np.array_equal(out[3200:-3200], clip)
    assert not out[:3200].any() and not out[-3200:].any()


def test_an_8k_clip_is_resampled_as_a_live_stream_hears_it() -> None:
    """A telephone clip that starts on its first word, decoded by the batch route, and the
    same clip streamed in 20 ms pieces through a live session's resampler with silence
    around it: the same samples (the batch route cut the resampler's edges off, and the ASR
    then heard G.711 questions differently live and in batch; both now bring 8 kHz up by the
    same interpolation)."""
    clip = _speech(8000, 0.6)
    pcm, _ = decode_audio(_wav(clip, 8000), 16000)
    batch = np.frombuffer(pcm, "<i2").astype(np.int32)
    live_in = np.concatenate([np.zeros(8000, "<i2"), clip, np.zeros(8000, "<i2")]).tobytes()
    rs = input_resampler(8000, 16000)  # the live session's (no delay at 8 kHz)
    live_pcm = b"".join(rs.process(live_in[i : i + 320]) for i in range(0, len(live_in), 320))
    live = np.frombuffer(live_pcm + rs.flush(), "<i2").astype(np.int32)
    # the batch output starts 0.2 s before the clip, the live one 1 s before it
    aligned = live[16000 - 3200 : 16000 - 3200 + batch.size]
    assert np.abs(aligned - batch).max() == 0
    first = int(np.nonzero(np.abs(batch) > 100)[0][0])
    assert first >= 3000  # silence before the clip's first word, for the ASR's margin
