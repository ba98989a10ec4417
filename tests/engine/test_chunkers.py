"""Edge adapters: text deltas -> segments, codec frames -> windows with left context."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from duplex_contract.batch import TextOut
from engine.config import SegmenterConfig
from engine.messages import TokensOut
from engine.pipeline.chunkers import SegmentChunker, WindowChunker, WindowOptions


def test_windows_first_small_then_with_left_context() -> None:
    ch = WindowChunker(
        WindowOptions(frame_size=2, first_frames=2, window_frames=3, context_frames=1)
    )
    out = ch.push(TokensOut(request_id="r", ids=tuple(range(5))))  # 2.5 frames
    assert [(c.ids, c.context, c.final) for c in out] == [((0, 1, 2, 3), 0, False)]
    out = ch.push(TokensOut(request_id="r", ids=tuple(range(5, 12))))  # up to 6 frames
    # 3 new frames (4..9) with one frame of context (2, 3)
    assert [(c.ids, c.context) for c in out] == [((2, 3, 4, 5, 6, 7, 8, 9), 2)]
    out = ch.flush()  # frame (10, 11) with context (8, 9); nothing partial left
    assert [(c.ids, c.context, c.final) for c in out] == [((8, 9, 10, 11), 2, True)]
    assert ch.flush() == []


@given(
    n=st.integers(0, 200),
    pieces=st.lists(st.integers(1, 9), min_size=1, max_size=40),
    first=st.integers(1, 5),
    window=st.integers(1, 8),
    context=st.integers(0, 4),
)
def test_windows_without_context_cover_every_whole_frame_once(
    n: int, pieces: list[int], first: int, window: int, context: int
) -> None:
    f = 3
    ch = WindowChunker(
        WindowOptions(
            frame_size=f, first_frames=first, window_frames=window, context_frames=context
        )
    )
    ids = list(range(n))
    chunks = []
    i = k = 0
    while i < n:
        size = pieces[k % len(pieces)]
        chunks += ch.push(TokensOut(request_id="r", ids=tuple(ids[i : i + size])))
        i, k = i + size, k + 1
    chunks += ch.flush()
    new = [x for c in chunks for x in c.ids[c.context :]]
    assert new == ids[: n - n % f]  # each whole frame exactly once, in order
    for c in chunks:
        assert c.context % f == 0 and c.context <= context * f and len(c.ids) % f == 0
    if chunks:
        assert chunks[0].context == 0 and len(chunks[0].ids) <= max(first * f, len(new))


def test_segments_release_the_first_clause_early() -> None:
    ch = SegmentChunker(SegmenterConfig(first_min_words=2, first_max_words=4, max_words=40))
    out = []
    for word in "Sure, I can help with that. It is sunny today.".split(" "):
        out += ch.push(TextOut(request_id="r", text=word + " "))
    out += ch.flush()
    texts = [c.text for c in out]
    assert len(texts) >= 2 and len(texts[0].split()) <= 4
    assert " ".join(t.strip() for t in texts).split() == (
        "Sure, I can help with that. It is sunny today.".split()
    )
