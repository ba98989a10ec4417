"""Codec stage: the SNAC 24 kHz decoder (torch, the ``snac`` package) on the batching runtime.

Consumes ``codec`` (windows of frames, :class:`TokensRequest`), emits ``audio``. The layout
(engine/codec_layout.py, ``orpheus``) says how a window's flat codes split into SNAC's three
codebooks; a window with a partial frame or a code out of range fails with a clear error and
nothing of it is decoded.

Async chunking (:class:`CodecChunker`, this backend's ``make_chunker``): the first window
emits ``first_frames`` frames (time to first audio), later windows twice as many as the one
before, up to ``window_frames`` new frames each (so the client's buffer grows while the talker
runs ahead), with ``context_frames`` of left context re-sent in front. SNAC's decoder is not causal:
a frame's samples depend on about 2.3 frames either side (measured: changing one frame moves
samples from 2.31 frames before it to 2.31 after it; convolutions, transposed convolutions
and dilated residual units, no attention in the 24 kHz model). So each non-final window also
carries ``lookahead_frames`` frames past what it emits; those frames are emitted by the next
window. With ``context_frames >= 3`` and ``lookahead_frames >= 3`` every emitted sample is
computed from exactly the codes a one-shot decode sees, and the joined chunks equal a one-shot
decode of the same codes (to float rounding: tests/vllm/test_codec_snac.py). SNAC's noise
blocks (random noise scaled by a learned projection) are off by default (``noise: false``):
random noise would make no two decodes equal, chunked or not.

Batching: one ``step`` decodes the pending windows of every session on the replica in one
decoder call (``max_batch`` at most). Windows of different lengths share the call by padding:
a non-final window is padded on the right (the padding reaches at most 2.3 frames into its
look-ahead, which it does not emit), a final window with ``context_frames >= 3`` on the left
(into its context). A window that can be padded neither way (a short clause: first and final
window at once) runs in a call with the windows of its own length. ``decode_calls`` and
``rows_decoded`` count what happened (tests, benchmarks).

Output: PCM16 at 24 kHz, resampled to the request's rate by the stream resampler
(audio_kit.pcm.StreamResampler, one per output stream, flushed at the stream's final window),
cut into ``chunk_ms`` pieces.

Weights: ``model`` is a directory holding SNAC's ``config.json`` and ``pytorch_model.bin``
(e.g. a deployment's copy of snac_24khz); ``null`` builds the published 24 kHz architecture
with random weights (seeded), for CI: its audio is noise. Nothing is downloaded.
"""

from __future__ import annotations

import logging
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

import msgspec
import numpy as np

from audio_kit.pcm import StreamResampler, split_pcm
from duplex_contract.batch import AudioOut
from duplex_contract.errors import ConfigError, StageError
from engine.codec_layout import CodecLayout, FrameError, IntArray, get_layout
from engine.messages import StageDone, StageOutput, StageRequest, TokensOut, TokensRequest
from engine.orchestration.chunkers import Chunk
from engine.orchestration.edges import Edge
from engine.snac_model import EXACT_MARGIN_FRAMES, SNAC_24KHZ, build_snac, decode_rows
from engine.stages.batching import BatchingBackend, BatchSlot

log = logging.getLogger(__name__)


class CodecSnacOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    layout: str = "orpheus"  # engine/codec_layout.py
    # SNAC directory (config.json + pytorch_model.bin); None: published 24 kHz config, random
    # weights (CI: noise). Never downloaded.
    model: str | None = None
    seed: int = 0  # random init
    # Overrides of the SNAC config for the random-init model (tests use a narrower decoder).
    config: dict[str, Any] = {}
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    noise: bool = False  # SNAC's noise blocks (non-deterministic: chunks would not join)
    first_frames: Annotated[int, msgspec.Meta(ge=1)] = 2
    window_frames: Annotated[int, msgspec.Meta(ge=1)] = 8
    context_frames: Annotated[int, msgspec.Meta(ge=0)] = EXACT_MARGIN_FRAMES
    lookahead_frames: Annotated[int, msgspec.Meta(ge=0)] = EXACT_MARGIN_FRAMES
    max_batch: Annotated[int, msgspec.Meta(ge=1)] = 16
    chunk_ms: Annotated[float, msgspec.Meta(ge=10, le=2000)] = 100.0
    threads: Annotated[int, msgspec.Meta(ge=1)] | None = None  # torch CPU threads (None: torch's)


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
class _Window:
    codes: list[IntArray]  # per codebook
    frames: int
    emit_from: int  # frames
    emit_to: int


class SnacCodec(BatchingBackend):
    """Codec frames -> PCM16 (see the module docstring)."""

    Options: ClassVar[type[msgspec.Struct]] = CodecSnacOptions
    consumes: Edge = Edge.CODEC
    emits: Edge = Edge.AUDIO
    device_kinds: ClassVar[frozenset[str]] = frozenset({"cpu", "cuda"})
    default_max_batch: ClassVar[int] = 16

    def __init__(
        self, options: CodecSnacOptions, name: str, *, device: str = "cpu", stage: str | None = None
    ) -> None:
        super().__init__(options, name, device=device, stage=stage)
        self.opts = options
        where = f"engine.stages.{self.stage}.options.layout"
        try:
            self.layout: CodecLayout = get_layout(options.layout)
        except FrameError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        if self.layout.codec != "snac_24khz":
            raise ConfigError(f"{where}: layout {options.layout!r} is for {self.layout.codec}")
        self.exact = (
            options.context_frames >= EXACT_MARGIN_FRAMES
            and options.lookahead_frames >= EXACT_MARGIN_FRAMES
        )
        self._model: Any = None
        self._torch: Any = None
        self._resamplers: OrderedDict[str, StreamResampler] = OrderedDict()
        # figures (worker thread): decoder calls, windows decoded, seconds in the decoder
        self.decode_calls = 0
        self.rows_decoded = 0
        self.decode_s = 0.0
        # per step: decoder seconds and seconds of audio emitted (the pool wires it to /metrics)
        self.on_decode: Callable[[float, float], None] | None = None

    @classmethod
    def cuda_device_count(cls) -> int:
        try:
            import torch
        except ImportError:
            return 0
        return int(torch.cuda.device_count())

    def make_chunker(self) -> CodecChunker:
        o = self.opts
        return CodecChunker(
            self.layout.frame_size,
            o.first_frames,
            o.window_frames,
            o.context_frames,
            o.lookahead_frames,
        )

    # ------------------------------------------------------------------ model
    def load(self) -> None:
        o = self.opts
        self._model, self._torch = build_snac(
            self.device,
            model=o.model,
            seed=o.seed,
            config=o.config,
            dtype=o.dtype,
            noise=o.noise,
            threads=o.threads,
            where=f"engine.stages.{self.stage}.options",
        )
        self.decode(
            [[np.zeros(self.opts.first_frames * p, dtype=np.int64) for p in self.layout.per_frame]]
        )  # warm-up

    def unload(self) -> None:
        self._model = None

    def decode(self, rows: Sequence[Sequence[IntArray]]) -> Any:
        """One decoder call on equal-length rows of per-codebook codes -> float32 [B, T]."""
        t0 = time.perf_counter()
        audio = decode_rows(self._model, self._torch, rows, self.device)
        self.decode_calls += 1
        self.rows_decoded += len(rows)
        self.decode_s += time.perf_counter() - t0
        return audio

    # ------------------------------------------------------------------ runtime
    def prepare(self, request: StageRequest) -> _Window:
        if not isinstance(request, TokensRequest):
            raise StageError(f"{self.name}: expected a TokensRequest, got {type(request).__name__}")
        f = self.layout.frame_size
        if request.context % f:
            raise StageError(f"{self.name}: context of {request.context} ids is not whole frames")
        try:
            codes = self.layout.split(request.ids)
        except FrameError as exc:
            raise StageError(f"{self.name}: {exc}") from None
        frames = len(request.ids) // f
        emit_from = request.context // f
        emit_to = frames if request.final else max(emit_from, frames - self.opts.lookahead_frames)
        return _Window(codes, frames, emit_from, emit_to)

    def _pad(self, w: _Window, length: int, final: bool) -> tuple[list[IntArray], int] | None:
        """Codes padded to ``length`` frames and the frame offset of w's first frame, or None
        when padding would change what ``w`` emits."""
        extra = length - w.frames
        if extra == 0:
            return w.codes, 0
        per = self.layout.per_frame
        if not final and self.opts.lookahead_frames >= EXACT_MARGIN_FRAMES:
            return [np.pad(c, (0, extra * p)) for c, p in zip(w.codes, per, strict=True)], 0
        if w.emit_from >= EXACT_MARGIN_FRAMES:
            return [np.pad(c, (extra * p, 0)) for c, p in zip(w.codes, per, strict=True)], extra
        return None

    def step(self, batch: Sequence[BatchSlot]) -> None:
        slots = [s for s in batch if s.state.emit_to > s.state.emit_from]
        empty = [s for s in batch if s.state.emit_to <= s.state.emit_from]
        groups: list[tuple[int, list[tuple[BatchSlot, list[IntArray], int]]]] = []
        if slots:
            length = max(s.state.frames for s in slots)
            main: list[tuple[BatchSlot, list[IntArray], int]] = []
            odd: dict[int, list[tuple[BatchSlot, list[IntArray], int]]] = {}
            for s in slots:
                req = s.request
                assert isinstance(req, TokensRequest)
                padded = self._pad(s.state, length, req.final)
                if padded is None:
                    odd.setdefault(s.state.frames, []).append((s, s.state.codes, 0))
                else:
                    main.append((s, *padded))
            if main:
                groups.append((length, main))
            groups.extend(sorted(odd.items()))
        spf = self.layout.samples_per_frame
        done: list[tuple[BatchSlot, Any]] = []  # decode everything first: a raise changes nothing
        busy = self.decode_s
        for _, rows in groups:
            audio = self.decode([codes for _, codes, _ in rows])
            for (s, _, off), wav in zip(rows, audio, strict=True):
                w: _Window = s.state
                done.append((s, wav[(off + w.emit_from) * spf : (off + w.emit_to) * spf]))
        hook = self.on_decode
        audio_s = sum(len(wav) for _, wav in done) / self.layout.sample_rate
        if hook is not None and audio_s > 0:
            hook(self.decode_s - busy, audio_s)
        for s in empty:
            self._finish(s, np.zeros(0, dtype=np.float32))
        for s, wav in done:
            self._finish(s, wav)

    def _finish(self, slot: BatchSlot, wav: Any) -> None:
        req = slot.request
        assert isinstance(req, TokensRequest)
        pcm = (np.clip(wav, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()
        rate = req.sample_rate
        native = self.layout.sample_rate
        if rate != native:
            key = stream_key(req.request_id)
            res = self._resamplers.pop(key, None) or StreamResampler(native, rate)
            pcm = res.process(pcm)
            if req.final:
                pcm += res.flush()
            else:
                self._resamplers[key] = res
                while len(self._resamplers) > 4 * self.max_batch + 64:  # aborted streams
                    self._resamplers.popitem(last=False)
        now = time.monotonic_ns()
        for piece in split_pcm(pcm, rate, self.opts.chunk_ms) if pcm else []:
            slot.emit(AudioOut(request_id=req.request_id, pcm=piece, sample_rate=rate, t_ns=now))
        slot.emit(StageDone(request_id=req.request_id))
        slot.finish()


__all__ = ["EXACT_MARGIN_FRAMES", "SNAC_24KHZ", "CodecChunker", "CodecSnacOptions", "SnacCodec"]
