"""Codec stage: the SNAC 24 kHz decoder (torch, the ``snac`` package) on the batching runtime.

Consumes ``codec`` (windows of frames, :class:`TokensRequest`), emits ``audio``. The layout
(engine/codec_layout.py, ``orpheus``) says how a window's flat codes split into SNAC's three
codebooks; a window with a partial frame or a code out of range fails with a clear error and
nothing of it is decoded.

Windows (engine/stages/codec_windows.py): this backend's ``make_chunker`` cuts the talker's
codes into windows that grow from ``first_frames`` to ``window_frames`` new frames, with
``context_frames`` of left context and ``lookahead_frames`` past what each emits. With both
margins >= 3 frames (SNAC's reach) the joined chunks equal a one-shot decode of the same codes
(to float rounding: tests/vllm/test_codec_snac.py). SNAC's noise blocks (random noise scaled by
a learned projection) are off by default (``noise: false``): random noise would make no two
decodes equal, chunked or not.

Batching: one ``step`` decodes the pending windows of every session on the replica in as few
decoder calls as their lengths allow (``plan_calls``: padded to one length where that changes
nothing they emit), ``max_batch`` windows at most. :class:`SnacDecoder` holds the torch model
and counts ``decode_calls``, ``rows_decoded`` and ``decode_s`` (tests, benchmarks).

Output: PCM16 at 24 kHz, resampled to the request's rate by the stream resampler
(audio_kit.pcm.StreamResampler, one per output stream, flushed at the stream's final window),
cut into ``chunk_ms`` pieces.

Weights: ``model`` is a directory holding SNAC's ``config.json`` and ``pytorch_model.bin``
(e.g. a deployment's copy of snac_24khz); ``null`` builds the published 24 kHz architecture
with random weights (seeded), for CI: its audio is noise. Nothing is downloaded.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Annotated, Any, ClassVar, Literal

import msgspec
import numpy as np

from audio_kit.pcm import StreamResampler, split_pcm
from duplex_contract.batch import AudioOut
from duplex_contract.errors import ConfigError, StageError
from engine.codec_layout import CodecLayout, FrameError, IntArray, get_layout
from engine.gpu_memory import GpuMemory
from engine.messages import StageDone, StageRequest, TokensRequest
from engine.snac_model import EXACT_MARGIN_FRAMES, build_snac, decode_rows
from engine.stages.batching import BatchingRuntime, BatchSlot
from engine.stages.codec_windows import CodecChunker, Window, plan_calls, stream_key, window_of
from engine.stages.edges import Edge
from engine.stages.stage_front import BatchingFront

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
    # wait this long after a window arrives at an idle decoder for others to join its call
    # (fewer, fuller calls: on a GPU other stages share, each call costs a fixed ~3 ms)
    gather_ms: Annotated[float, msgspec.Meta(ge=0, le=200)] = 0.0
    chunk_ms: Annotated[float, msgspec.Meta(ge=10, le=2000)] = 100.0
    threads: Annotated[int, msgspec.Meta(ge=1)] | None = None  # torch CPU threads (None: torch's)


class SnacDecoder:
    """The SNAC decoder of one replica (torch) and what it did: decoder calls, windows
    decoded, seconds in the decoder (worker thread)."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.model: Any = None
        self.torch: Any = None
        self.decode_calls = 0
        self.rows_decoded = 0
        self.decode_s = 0.0

    def load(self, o: CodecSnacOptions, where: str) -> None:
        self.model, self.torch = build_snac(
            self.device,
            model=o.model,
            seed=o.seed,
            config=o.config,
            dtype=o.dtype,
            noise=o.noise,
            threads=o.threads,
            where=where,
        )

    def unload(self) -> None:
        self.model = None

    def decode(self, rows: Sequence[Sequence[IntArray]]) -> Any:
        """One decoder call on equal-length rows of per-codebook codes -> float32 [B, T]."""
        t0 = time.perf_counter()
        audio = decode_rows(self.model, self.torch, rows, self.device)
        self.decode_calls += 1
        self.rows_decoded += len(rows)
        self.decode_s += time.perf_counter() - t0
        return audio


class SnacCodec(BatchingFront):
    """Codec frames -> PCM16 (see the module docstring).

    The stage interface is its :class:`BatchingRuntime`'s; this class is the model
    (``load``, ``prepare``, ``step``, ``unload``: engine/stages/batching.py): it turns
    requests into windows, has them decoded by its :class:`SnacDecoder` and emits the
    audio of each stream."""

    Options: ClassVar[type[msgspec.Struct]] = CodecSnacOptions
    consumes: Edge = Edge.CODEC
    emits: Edge = Edge.AUDIO
    device_kinds: ClassVar[frozenset[str]] = frozenset({"cpu", "cuda"})
    keeps_auto: ClassVar[bool] = False

    def __init__(
        self, options: CodecSnacOptions, name: str, *, device: str = "cpu", stage: str | None = None
    ) -> None:
        self.opts = options
        self.name = name
        self.device = device
        self.stage = stage or name
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
        self.decoder = SnacDecoder(device)
        self._resamplers: OrderedDict[str, StreamResampler] = OrderedDict()
        # per step: decoder seconds and seconds of audio emitted (the pool wires it to /metrics)
        self.on_decode: Callable[[float, float], None] | None = None
        self.runtime = BatchingRuntime(
            name, self, options.max_batch, gather_s=options.gather_ms / 1000
        )

    def serving(self) -> BatchingRuntime:
        return self.runtime

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

    # -- the stage interface: its runtime's --------------------------------------------
    @property
    def capacity(self) -> int:
        return self.runtime.capacity

    def gpu_memory(self) -> GpuMemory:
        """What it takes on a GPU (engine/gpu_memory.py), an estimate: SNAC 24 kHz's weights
        (~0.08 GiB in float32) and the activations of a batch of windows (~12 MiB each)."""
        return GpuMemory(gib=0.2 + 0.0125 * self.runtime.max_batch)

    # -- the model (worker thread) -----------------------------------------------------
    def load(self) -> None:
        self.decoder.load(self.opts, where=f"engine.stages.{self.stage}.options")
        self.decoder.decode(
            [[np.zeros(self.opts.first_frames * p, dtype=np.int64) for p in self.layout.per_frame]]
        )  # warm-up

    def unload(self) -> None:
        self.decoder.unload()

    def prepare(self, request: StageRequest) -> Window:
        if not isinstance(request, TokensRequest):
            raise StageError(f"{self.name}: expected a TokensRequest, got {type(request).__name__}")
        if request.context % self.layout.frame_size:
            raise StageError(f"{self.name}: context of {request.context} ids is not whole frames")
        try:
            return window_of(request, self.layout, self.opts.lookahead_frames)
        except FrameError as exc:
            raise StageError(f"{self.name}: {exc}") from None

    def step(self, batch: Sequence[BatchSlot]) -> None:
        windows: list[Window] = [s.state for s in batch]
        calls = plan_calls(windows, self.layout.per_frame, self.opts.lookahead_frames)
        spf = self.layout.samples_per_frame
        done: list[tuple[BatchSlot, Any]] = []  # decode everything first: a raise changes nothing
        busy = self.decoder.decode_s
        for rows in calls:
            audio = self.decoder.decode([codes for _, codes, _ in rows])
            for (i, _, off), wav in zip(rows, audio, strict=True):
                w = windows[i]
                done.append((batch[i], wav[(off + w.emit_from) * spf : (off + w.emit_to) * spf]))
        hook = self.on_decode
        audio_s = sum(len(wav) for _, wav in done) / self.layout.sample_rate
        if hook is not None and audio_s > 0:
            hook(self.decoder.decode_s - busy, audio_s)
        for s, w in zip(batch, windows, strict=True):
            if w.empty:
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
                while len(self._resamplers) > 4 * self.runtime.max_batch + 64:  # aborted streams
                    self._resamplers.popitem(last=False)
        now = time.monotonic_ns()
        for piece in split_pcm(pcm, rate, self.opts.chunk_ms) if pcm else []:
            slot.emit(AudioOut(request_id=req.request_id, pcm=piece, sample_rate=rate, t_ns=now))
        slot.emit(StageDone(request_id=req.request_id))
        slot.finish()


__all__ = ["CodecSnacOptions", "SnacCodec", "SnacDecoder"]
