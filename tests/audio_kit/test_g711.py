"""G.711 in the audio kit: both laws round-trip speech-level audio within G.711's error,
the tables are libsndfile's (exact on the codes), and bad input fails with ValueError."""

from __future__ import annotations

import numpy as np
import pytest

from audio_kit.g711 import CODECS, g711_to_pcm16, pcm16_to_g711


@pytest.mark.parametrize("codec", CODECS)
def test_round_trip_of_a_tone_is_within_g711_error(codec: str) -> None:
    tone = (np.sin(np.arange(800) / 8000 * 2 * np.pi * 300) * 12000).astype("<i2").tobytes()
    coded = pcm16_to_g711(tone, codec)
    assert len(coded) == 800  # one byte a sample
    back = np.frombuffer(g711_to_pcm16(coded, codec), dtype="<i2")
    err = np.abs(back.astype(int) - np.frombuffer(tone, dtype="<i2").astype(int))
    assert err.max() < 12000 * 0.05  # G.711 is ~8 bits log: a few percent
    assert err.max() > 0  # and lossy: this is not a pass-through


@pytest.mark.parametrize("codec", CODECS)
def test_every_code_decodes_and_encodes_back_to_itself(codec: str) -> None:
    codes = bytes(range(256))
    pcm = g711_to_pcm16(codes, codec)
    assert len(pcm) == 512
    again = pcm16_to_g711(pcm, codec)
    # μ-law has two codes for zero (0x7F and 0xFF): every other code is its own round trip
    diff = [c for c, d in zip(codes, again, strict=True) if c != d]
    assert len(diff) <= 1


def test_the_two_laws_differ() -> None:
    tone = (np.arange(-16000, 16000, 1000)).astype("<i2").tobytes()
    assert pcm16_to_g711(tone, "g711_ulaw") != pcm16_to_g711(tone, "g711_alaw")


@pytest.mark.parametrize("codec", ["pcm16", "ulaw", ""])
def test_an_unknown_codec_is_refused(codec: str) -> None:
    with pytest.raises(ValueError, match=r"not a G\.711 codec"):
        g711_to_pcm16(b"\x00", codec)
    with pytest.raises(ValueError, match=r"not a G\.711 codec"):
        pcm16_to_g711(b"\x00\x00", codec)


def test_odd_length_pcm_is_refused() -> None:
    with pytest.raises(ValueError, match="2 bytes a sample"):
        pcm16_to_g711(b"\x00\x00\x00", "g711_ulaw")
