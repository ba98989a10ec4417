"""Edge adapters: how one stage's output stream becomes the next stage's requests.

Between two output stages of a route, the consumer decides how it wants its input cut:

* a stage that consumes ``text`` gets one request per *segment* (the segmenter releases the
  first clause early, then sentence-sized pieces): :class:`SegmentChunker`;
* a stage that consumes ``tokens`` or ``codec`` gets *windows* of frames:
  :class:`WindowChunker` (a small first window for time to first audio, then windows with
  left context that the stage decodes but does not emit again, so the joined outputs equal
  a one-shot decode).

A backend may provide its own with a ``make_chunker()`` method; otherwise the default for
its ``consumes`` edge is used. Each chunk carries a ``mark``: the text it speaks, set on the
first chunk that descends from a segment, so transcripts can be cut to what was heard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Protocol

import msgspec

from duplex_contract.batch import TextOut, TranscriptOut
from engine.config import SegmenterConfig
from engine.messages import StageOutput, TokensOut
from engine.pipeline.segmenter import Segmenter
from engine.stages.edges import Edge


@dataclass(frozen=True)
class Chunk:
    """One request's worth of input for the next stage."""

    text: str = ""  # a text segment (edge text)
    ids: tuple[int, ...] = ()  # token ids / codec codes (edges tokens, codec)
    context: int = 0  # leading ids that are left context only
    final: bool = False  # the last chunk of its upstream request


class Chunker(Protocol):
    def push(self, out: StageOutput) -> list[Chunk]: ...

    def flush(self) -> list[Chunk]: ...


class SegmentChunker:
    """Text deltas -> segments (engine.segmenter settings)."""

    def __init__(self, config: SegmenterConfig, *, early_first: bool = True) -> None:
        self._seg = Segmenter(config, early_first=early_first)

    def push(self, out: StageOutput) -> list[Chunk]:
        if isinstance(out, TextOut | TranscriptOut) and out.text:
            return [Chunk(text=s) for s in self._seg.push(out.text)]
        return []

    def flush(self) -> list[Chunk]:
        return [Chunk(text=s) for s in self._seg.flush()]


class WindowOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Windowing of a frame stream (a codec decoder's ``window`` option block)."""

    frame_size: Annotated[int, msgspec.Meta(ge=1)] = 1  # ids per frame
    first_frames: Annotated[int, msgspec.Meta(ge=1)] = 4  # frames in the first window
    window_frames: Annotated[int, msgspec.Meta(ge=1)] = 16  # new frames per later window
    context_frames: Annotated[int, msgspec.Meta(ge=0)] = 4  # left-context frames re-sent


class WindowChunker:
    """Token/codec ids -> windows of whole frames with left context."""

    def __init__(self, options: WindowOptions) -> None:
        self.o = options
        self._ids: list[int] = []  # every id received (whole and partial frames)
        self._sent = 0  # frames already released

    def _frames(self) -> int:
        return len(self._ids) // self.o.frame_size

    def _window(self, upto: int, final: bool) -> Chunk:
        f = self.o.frame_size
        ctx = min(self.o.context_frames, self._sent)
        start = self._sent - ctx
        ids = tuple(self._ids[start * f : upto * f])
        self._sent = upto
        return Chunk(ids=ids, context=ctx * f, final=final)

    def push(self, out: StageOutput) -> list[Chunk]:
        if not isinstance(out, TokensOut):
            return []
        self._ids.extend(out.ids)
        chunks: list[Chunk] = []
        while True:
            need = self.o.first_frames if self._sent == 0 else self.o.window_frames
            if self._frames() - self._sent < need:
                return chunks
            chunks.append(self._window(self._sent + need, final=False))

    def flush(self) -> list[Chunk]:
        """The rest of the whole frames (a trailing partial frame is dropped)."""
        frames = self._frames()
        if frames > self._sent:
            return [self._window(frames, final=True)]
        return []


def default_chunker(
    consumes: Edge, segmenter: SegmenterConfig, *, early_first: bool = True
) -> Chunker:
    """``early_first=False``: text known whole (batch speech): sentence-sized segments only."""
    if consumes is Edge.TEXT:
        return SegmentChunker(segmenter, early_first=early_first)
    return WindowChunker(WindowOptions())


__all__ = [
    "Chunk",
    "Chunker",
    "SegmentChunker",
    "WindowChunker",
    "WindowOptions",
    "default_chunker",
]
