"""engine/stages/codec_windows.py alone (pure, no torch): cutting a talker's codes into
windows, a window's emit range, padding, and which windows share a decoder call."""

from __future__ import annotations

import pytest

from duplex_contract.batch import TextOut
from engine.codec_layout import FrameError, get_layout
from engine.messages import TokensOut, TokensRequest
from engine.stages.codec_windows import (
    CodecChunker,
    Window,
    pad,
    plan_calls,
    stream_key,
    window_of,
)

ORPHEUS = get_layout("orpheus")
F = ORPHEUS.frame_size  # 7 codes a frame over codebooks of 1, 2 and 4 codes


def codes(frames: int) -> tuple[int, ...]:
    return tuple(range(frames * F))


def win(frames: int, *, context: int = 0, final: bool = False, lookahead: int = 3) -> Window:
    request = TokensRequest(
        request_id="s/codec0", ids=codes(frames), context=context * F, final=final
    )
    return window_of(request, ORPHEUS, lookahead)


def test_stream_key_drops_the_window_number() -> None:
    assert stream_key("sess_a/e0/t1/r1/codec12") == "sess_a/e0/t1/r1/codec"
    assert stream_key("codec") == "codec"


def test_the_chunker_grows_windows_with_context_and_lookahead() -> None:
    chunker = CodecChunker(F, first=2, window=8, context=3, lookahead=3)
    chunks = chunker.push(TokensOut(request_id="t", ids=codes(4)))
    assert chunks == []  # 2 new + 3 look-ahead frames needed
    chunks = chunker.push(TokensOut(request_id="t", ids=codes(1)))
    assert [(len(c.ids) // F, c.context // F, c.final) for c in chunks] == [(5, 0, False)]
    chunks = chunker.push(TokensOut(request_id="t", ids=codes(16)))
    # then 4 new frames (twice the last), then 8 (the cap), each with 2-3 frames of context
    assert [(len(c.ids) // F, c.context // F) for c in chunks] == [(9, 2), (14, 3)]
    (last,) = chunker.flush()  # the rest: frames 14-21, after 3 frames of context
    assert last.final and last.context == 3 * F and len(last.ids) == (21 - 14 + 3) * F
    assert chunker.flush() == []
    assert chunker.push(TextOut(request_id="t", text="x")) == []  # not codec frames


def test_a_window_emits_between_its_context_and_its_lookahead() -> None:
    w = win(10, context=3)
    assert (w.frames, w.emit_from, w.emit_to, w.final, w.empty) == (10, 3, 7, False, False)
    assert [len(c) for c in w.codes] == [10, 20, 40]  # per codebook
    final = win(10, context=3, final=True)
    assert (final.emit_from, final.emit_to) == (3, 10)
    assert win(3, context=3, final=True).empty  # only context: nothing to emit
    assert win(4, context=2).emit_to == 2  # never before its context ends
    with pytest.raises(FrameError):
        window_of(TokensRequest(request_id="x", ids=codes(2)[:-1]), ORPHEUS, 3)


def test_padding_never_changes_what_a_window_emits() -> None:
    per = ORPHEUS.per_frame
    same, off = pad(win(6), 6, per, 3)  # type: ignore[misc]
    assert off == 0 and [len(c) for c in same] == [6, 12, 24]
    right = pad(win(4), 6, per, 3)  # not final: zeros after, into its look-ahead
    assert right is not None and right[1] == 0 and [len(c) for c in right[0]] == [6, 12, 24]
    assert int(right[0][0][-1]) == 0
    left = pad(win(5, context=3, final=True), 6, per, 3)  # final: zeros before, in its context
    assert left is not None and left[1] == 1 and [len(c) for c in left[0]] == [6, 12, 24]
    assert int(left[0][0][0]) == 0
    assert pad(win(4, final=True), 6, per, 3) is None  # a short first-and-final window
    assert pad(win(4), 6, per, 2) is None  # a look-ahead shorter than SNAC's reach


def test_windows_share_calls_where_padding_allows() -> None:
    windows = [
        win(9),  # the longest
        win(5),  # padded right
        win(6, context=3, final=True),  # padded left
        win(4, final=True),  # cannot be padded: its own call
        win(4, final=True),  # ... with the other of its length
        win(3, final=True),  # another length: another call
        win(3, context=3, final=True),  # emits nothing: no call
    ]
    calls = plan_calls(windows, ORPHEUS.per_frame, 3)
    assert [[i for i, _, _ in call] for call in calls] == [[0, 1, 2], [5], [3, 4]]
    for call in calls:
        assert len({len(codes[0]) for _, codes, _ in call}) == 1  # equal lengths in a call
    assert [off for _, _, off in calls[0]] == [0, 0, 3]
    assert plan_calls([windows[-1]], ORPHEUS.per_frame, 3) == []
