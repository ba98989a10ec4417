"""Frame parsing of the Orpheus layout: token streams -> codes, and codes -> SNAC codebooks."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.codec_layout import ORPHEUS, FrameError

pytestmark = pytest.mark.vllm

L = ORPHEUS


@settings(max_examples=60, deadline=None)
@given(st.data(), st.integers(0, 40))
def test_random_token_streams_parse_into_in_range_codes(data: st.DataObject, frames: int) -> None:
    codes = data.draw(st.lists(st.integers(0, 4095), min_size=7 * frames, max_size=7 * frames))
    tokens = [L.audio_base + (i % 7) * 4096 + c for i, c in enumerate(codes)]
    assert L.tokens_to_codes(tokens) == codes
    books = L.split(codes)
    assert [len(b) for b in books] == [frames, 2 * frames, 4 * frames]
    for book in books:
        assert book.dtype == np.int64 and ((book >= 0) & (book < 4096)).all()
    assert L.join(books) == codes
    # the Orpheus order: frame j = c0[j], c1[2j], c2[4j], c2[4j+1], c1[2j+1], c2[4j+2], c2[4j+3]
    for j in range(frames):
        f = codes[7 * j : 7 * j + 7]
        assert books[0][j] == f[0]
        assert list(books[1][2 * j : 2 * j + 2]) == [f[1], f[4]]
        assert list(books[2][4 * j : 4 * j + 4]) == [f[2], f[3], f[5], f[6]]


def test_token_arithmetic_matches_the_published_layout() -> None:
    # <custom_token_N> is id 128256 + N; audio code c at position p is custom token 10 + 4096p + c
    assert L.position_range(0) == range(128266, 128266 + 4096)
    assert L.position_range(6).stop == 128266 + 7 * 4096
    assert L.token_to_code(128266 + 3 * 4096 + 17, 3) == 17
    assert L.frame_size == 7 and L.samples_per_frame == 2048 and L.sample_rate == 24000
    prompt = L.prompt_ids(lambda s: [128000, *range(len(s))], "hi", None)
    assert (
        prompt[0] == 128259
        and prompt[1] == 128000
        and prompt[-4:] == [128009, 128260, 128261, 128257]
    )


@pytest.mark.parametrize(
    ("token", "position", "needle"),
    [
        (128266 + 4096 + 5, 0, "another frame position (1)"),  # codebook 1's token at position 0
        (128266 + 7 * 4096, 6, "not an audio token"),  # one past the audio range
        (128009, 2, "not an audio token"),  # a text/control token
        (128265, 0, "not an audio token"),  # just below the range
    ],
)
def test_malformed_tokens_are_refused(token: int, position: int, needle: str) -> None:
    with pytest.raises(FrameError, match="frame position") as err:
        L.token_to_code(token, position)
    assert needle in str(err.value)


def test_malformed_code_windows_are_refused_not_decoded() -> None:
    with pytest.raises(FrameError, match="not whole frames of 7"):
        L.split([1] * 13)
    with pytest.raises(FrameError, match="code 4096 at frame 1 position 3 is out of range"):
        L.split([0] * 10 + [4096] + [0] * 3)
    with pytest.raises(FrameError, match="code -1 at frame 0 position 0"):
        L.split([-1] + [0] * 6)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 160_000), max_size=21), st.integers(0, 6))
def test_arbitrary_token_streams_parse_or_are_refused(tokens: list[int], start: int) -> None:
    """Any id stream: either every token is its position's audio token (codes in range), or
    the stream is refused with a FrameError; never an out-of-range code."""
    valid = all(t in L.position_range((start + i) % 7) for i, t in enumerate(tokens))
    if valid:
        codes = L.tokens_to_codes(tokens, start)
        assert all(0 <= c < 4096 for c in codes)
    else:
        with pytest.raises(FrameError):
            L.tokens_to_codes(tokens, start)
