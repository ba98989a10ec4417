"""Codec windows: how a talker's codes are cut into decoder windows, and how the windows of
several streams share one decoder call (the SNAC codec stage, engine/stages/codec_snac.py).

Pure arithmetic on codes (numpy, no torch): the stage decides when to decode, the decoder
how; this module decides *what*.

Cutting (:class:`CodecChunker`, the codec stage's ``make_chunker``): the first window emits
``first`` new frames (time to first audio), later windows twice as many as the one before,
up to ``window`` new frames each, with ``context`` frames of left context re-sent in front
and (not final) ``lookahead`` frames after what it emits. SNAC's decoder is not causal (a
frame's samples depend on about 2.3 frames either side), so with ``context >= 3`` and
``lookahead >= 3`` every emitted sample is computed from the codes a one-shot decode sees.

Sharing (:func:`plan_calls`): windows of different lengths share a call by padding. A
non-final window is padded on the right (the padding reaches at most 2.3 frames into its
look-ahead, which it does not emit), a final window with ``context_frames >= 3`` on the left
(into its context). A window that can be padded neither way (a short clause: first and
final window at once) runs in a call with the windows of its own length.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from engine.codec_layout import CodecLayout, IntArray
from engine.messages import StageOutput, TokensOut, TokensRequest
from engine.pipeline.chunkers import Chunk
from engine.snac_model import EXACT_MARGIN_FRAMES

_TRAILING_N = re.compile(r"\d+$")


def stream_key(request_id: str) -> str:
    """The output stream a window belongs to: its id without the window number."""
    return _TRAILING_N.sub("", request_id)


class CodecChunker:
    """Codec ids -> windows: ``first`` new frames, then twice as many each time up to
    ``window``, each with ``context`` frames before and (not final) ``lookahead`` frames
    after what it emits."""

    def __init__(self, frame_size: int, first: int, window: int, context: int, lookahead: int):
        self.f = frame_size
        self.first, self.window, self.context, self.lookahead = first, window, context, lookahead
        self._ids: list[int] = []
        self.emitted = 0  # frames whose audio a released window emits
        self._last = 0  # new frames of the last window

    def _frames(self) -> int:
        return len(self._ids) // self.f

    def _chunk(self, upto: int, final: bool) -> Chunk:
        ctx = min(self.context, self.emitted)
        start = self.emitted - ctx
        return Chunk(
            ids=tuple(self._ids[start * self.f : upto * self.f]), context=ctx * self.f, final=final
        )

    def push(self, out: StageOutput) -> list[Chunk]:
        if not isinstance(out, TokensOut):
            return []
        self._ids.extend(out.ids)
        chunks: list[Chunk] = []
        while True:
            # windows grow from ``first`` by doubling up to ``window``: the audio buffered at
            # the client grows as fast as the talker can fill it
            new = self.first if self.emitted == 0 else min(self.window, 2 * self._last)
            upto = self.emitted + new + self.lookahead
            if self._frames() < upto:
                return chunks
            chunks.append(self._chunk(upto, final=False))
            self.emitted += new
            self._last = new

    def flush(self) -> list[Chunk]:
        frames = self._frames()
        if frames > self.emitted:
            chunk = self._chunk(frames, final=True)
            self.emitted = frames
            return [chunk]
        return []


@dataclass
class Window:
    """One window to decode: its codes per codebook, its length and the frames it emits."""

    codes: list[IntArray]  # per codebook
    frames: int
    emit_from: int  # frames
    emit_to: int
    final: bool

    @property
    def empty(self) -> bool:
        """It emits no audio (a final window that holds only context)."""
        return self.emit_to <= self.emit_from


def window_of(request: TokensRequest, layout: CodecLayout, lookahead_frames: int) -> Window:
    """The window a request carries (``request.context`` whole frames of left context; the
    last ``lookahead_frames`` of a non-final window are not emitted). Raises
    :class:`engine.codec_layout.FrameError` for codes that are not whole, in-range frames."""
    f = layout.frame_size
    codes = layout.split(request.ids)
    frames = len(request.ids) // f
    emit_from = request.context // f
    emit_to = frames if request.final else max(emit_from, frames - lookahead_frames)
    return Window(codes, frames, emit_from, emit_to, request.final)


def pad(
    w: Window, length: int, per_frame: Sequence[int], lookahead_frames: int
) -> tuple[list[IntArray], int] | None:
    """``w``'s codes padded to ``length`` frames and the frame offset of its first frame, or
    None when padding would change what ``w`` emits."""
    extra = length - w.frames
    if extra == 0:
        return w.codes, 0
    if not w.final and lookahead_frames >= EXACT_MARGIN_FRAMES:
        return [np.pad(c, (0, extra * p)) for c, p in zip(w.codes, per_frame, strict=True)], 0
    if w.emit_from >= EXACT_MARGIN_FRAMES:
        return [np.pad(c, (extra * p, 0)) for c, p in zip(w.codes, per_frame, strict=True)], extra
    return None


#: one window of a decoder call: (its index in the windows planned, its codes as padded for
#: the call, the frame offset of its first frame in the call's output)
CallRow = tuple[int, list[IntArray], int]


def plan_calls(
    windows: Sequence[Window], per_frame: Sequence[int], lookahead_frames: int
) -> list[list[CallRow]]:
    """The decoder calls that decode every window that emits audio: one call of the longest
    length for all that can be padded to it, then one per length for those that cannot
    (shortest first). Each call's rows have equal lengths."""
    rows = [i for i, w in enumerate(windows) if not w.empty]
    if not rows:
        return []
    length = max(windows[i].frames for i in rows)
    main: list[CallRow] = []
    odd: dict[int, list[CallRow]] = {}
    for i in rows:
        w = windows[i]
        padded = pad(w, length, per_frame, lookahead_frames)
        if padded is None:
            odd.setdefault(w.frames, []).append((i, w.codes, 0))
        else:
            main.append((i, *padded))
    calls = [main] if main else []
    calls.extend(odd[frames] for frames in sorted(odd))
    return calls
