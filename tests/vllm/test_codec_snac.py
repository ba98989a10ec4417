"""The SNAC codec stage: chunked decode == one-shot decode, batching across sessions, refusals.

Tolerance: the stage emits PCM16. Windows decode exactly the codes a one-shot decode sees for
every sample they emit (context and look-ahead >= SNAC's 2.31-frame reach, see
engine/stages/codec_snac.py), so float32 results differ only by summation order across
different tensor lengths and paddings: measured <= 6e-7 of full scale, far below one PCM16
step (3.05e-5). Truncation to int16 can still flip a sample by one step, so joined chunks must
equal the one-shot decode within 1 LSB, and both must be the same length.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from duplex_contract.batch import AudioOut
from duplex_contract.errors import StageError
from engine.codec_layout import ORPHEUS
from engine.messages import StageDone, TokensOut, TokensRequest
from engine.stages.codec_snac import CodecSnacOptions, SnacCodec
from engine.stages.codec_windows import CodecChunker

pytestmark = pytest.mark.vllm

# The published 24 kHz architecture with a narrower decoder (dims do not change the reach:
# that is set by kernels, dilations and strides) so the property test runs many examples.
SMALL = CodecSnacOptions(config={"decoder_dim": 64}, threads=2, max_batch=16)


@pytest.fixture(scope="module")
def ref() -> Iterator[SnacCodec]:
    """A loaded replica never started: the one-shot reference and the shared model."""
    backend = SnacCodec(SMALL, "codec")
    backend.load()
    yield backend


def fresh(ref: SnacCodec, opts: CodecSnacOptions = SMALL) -> SnacCodec:
    """A replica with ``opts`` that shares ref's model (loading it again takes seconds)."""
    codec = SnacCodec(opts, "codec")
    codec.decoder.model, codec.decoder.torch = ref.decoder.model, ref.decoder.torch
    codec.load = lambda: None  # type: ignore[method-assign]
    codec.unload = lambda: None  # type: ignore[method-assign]
    return codec


def pcm16(wav: np.ndarray) -> np.ndarray:
    return (np.clip(wav, -1.0, 1.0) * 32767.0).astype(np.int16)


def one_shot(codec: SnacCodec, codes: list[int]) -> np.ndarray:
    return pcm16(codec.decoder.decode([ORPHEUS.split(codes)])[0])


def windows(codes: list[int], opts: CodecSnacOptions, step: int) -> list[TokensRequest]:
    ch = CodecChunker(
        7, opts.first_frames, opts.window_frames, opts.context_frames, opts.lookahead_frames
    )
    chunks = []
    for i in range(0, len(codes), step):
        chunks += ch.push(TokensOut(request_id="t", ids=tuple(codes[i : i + step])))
    chunks += ch.flush()
    return [
        TokensRequest(request_id=f"s/codec{n}", ids=c.ids, context=c.context, final=c.final)
        for n, c in enumerate(chunks)
    ]


async def run_streams(codec: SnacCodec, streams: list[list[TokensRequest]]) -> list[bytes]:
    """Each stream's windows one after another (as the pipeline does); streams concurrently."""

    async def one(i: int, reqs: list[TokensRequest]) -> bytes:
        pcm = b""
        for r in reqs:
            req = TokensRequest(
                request_id=f"sess{i}/{r.request_id}", ids=r.ids, context=r.context, final=r.final
            )
            async for out in codec.submit(req):
                if isinstance(out, AudioOut):
                    assert out.sample_rate == 24000
                    pcm += out.pcm
        return pcm

    return list(await asyncio.gather(*(one(i, s) for i, s in enumerate(streams))))


def decode_through_runtime(codec: SnacCodec, streams: list[list[TokensRequest]]) -> list[bytes]:
    async def main() -> list[bytes]:
        await codec.start()
        try:
            return await run_streams(codec, streams)
        finally:
            await codec.close()

    return asyncio.run(main())


@pytest.fixture(scope="module")
def shared(ref: SnacCodec) -> list[SnacCodec]:
    return [ref]


@settings(max_examples=25, deadline=None)
@given(
    st.data(),
    st.lists(st.integers(1, 30), min_size=1, max_size=3),  # frames per concurrent stream
    st.integers(1, 4),  # first window
    st.integers(1, 10),  # later windows
    st.integers(3, 5),  # context
    st.integers(3, 4),  # look-ahead
    st.integers(1, 20),  # ids per talker delta
)
def test_chunked_decode_equals_one_shot(
    shared: list[SnacCodec],
    data: st.DataObject,
    lengths: list[int],
    first: int,
    window: int,
    ctx: int,
    look: int,
    step: int,
) -> None:
    (ref,) = shared
    opts = CodecSnacOptions(
        config={"decoder_dim": 64},
        threads=2,
        first_frames=first,
        window_frames=window,
        context_frames=ctx,
        lookahead_frames=look,
    )
    codec = fresh(ref, opts)
    seqs = [
        data.draw(st.lists(st.integers(0, 4095), min_size=7 * n, max_size=7 * n)) for n in lengths
    ]
    joined = decode_through_runtime(codec, [windows(c, opts, step) for c in seqs])
    for codes, pcm in zip(seqs, joined, strict=True):
        want = one_shot(ref, codes)
        got = np.frombuffer(pcm, dtype=np.int16)
        assert len(got) == len(want) == 2048 * (len(codes) // 7)
        assert int(np.abs(got.astype(np.int32) - want).max()) <= 1


def test_the_published_config_joins_exactly_too() -> None:
    """The full-width 24 kHz decoder (CI config), one stream of uneven length."""
    opts = CodecSnacOptions(threads=2)
    codec = SnacCodec(opts, "codec")
    codes = [int(c) for c in np.random.default_rng(7).integers(0, 4096, 7 * 17)]
    codec.load()
    whole = one_shot(codec, codes)
    codec.load = lambda: None  # type: ignore[method-assign]
    (pcm,) = decode_through_runtime(codec, [windows(codes, opts, 7)])
    ref = whole
    got = np.frombuffer(pcm, dtype=np.int16)
    assert len(got) == len(ref) and int(np.abs(got.astype(np.int32) - ref).max()) <= 1


def test_windows_of_concurrent_streams_share_decode_calls(ref: SnacCodec) -> None:
    codec = fresh(ref)
    rng = np.random.default_rng(3)
    seqs = [[int(c) for c in rng.integers(0, 4096, 7 * n)] for n in (21, 21, 13, 30)]
    before_calls, before_rows = codec.decoder.decode_calls, codec.decoder.rows_decoded

    async def main() -> list[bytes]:
        await codec.start()
        try:
            return await run_streams(codec, [windows(c, SMALL, 7) for c in seqs])
        finally:
            await codec.close()

    joined = asyncio.run(main())
    rows = codec.decoder.rows_decoded - before_rows
    calls = codec.decoder.decode_calls - before_calls
    n_windows = sum(len(windows(c, SMALL, 7)) for c in seqs)
    assert rows == n_windows and calls < rows  # several streams' windows per decoder call
    assert codec.runtime.max_step_size >= 3
    for codes, pcm in zip(seqs, joined, strict=True):
        want = one_shot(ref, codes)
        got = np.frombuffer(pcm, dtype=np.int16)
        assert len(got) == len(want) and int(np.abs(got.astype(np.int32) - want).max()) <= 1


def test_malformed_windows_fail_with_a_clear_error_and_no_audio(ref: SnacCodec) -> None:
    codec = fresh(ref)

    async def main() -> list[tuple[str, list[object]]]:
        await codec.start()
        results = []
        try:
            for ids in ((1,) * 13, (0,) * 10 + (5000,) + (0,) * 3):
                outs: list[object] = []
                try:
                    async for out in codec.submit(TokensRequest(request_id="bad", ids=ids)):
                        outs.append(out)
                except StageError as exc:
                    results.append((str(exc), outs))
            # the replica goes on decoding well-formed windows
            good = [
                o
                async for o in codec.submit(
                    TokensRequest(request_id="ok", ids=(0,) * 14, final=True)
                )
            ]
            assert isinstance(good[-1], StageDone) and isinstance(good[0], AudioOut)
        finally:
            await codec.close()
        return results

    (partial, p_outs), (oor, o_outs) = asyncio.run(main())
    assert "not whole frames of 7" in partial and p_outs == []
    assert "code 5000 at frame 1 position 3 is out of range" in oor and o_outs == []


def test_resamples_to_the_session_rate(ref: SnacCodec) -> None:
    codec = fresh(ref)
    codes = [int(c) for c in np.random.default_rng(1).integers(0, 4096, 7 * 12)]
    reqs = windows(codes, SMALL, 7)

    async def main() -> int:
        await codec.start()
        total = 0
        try:
            for r in reqs:
                req = TokensRequest(
                    request_id=r.request_id,
                    ids=r.ids,
                    context=r.context,
                    final=r.final,
                    sample_rate=16000,
                )
                async for out in codec.submit(req):
                    if isinstance(out, AudioOut):
                        assert out.sample_rate == 16000
                        total += len(out.pcm) // 2
        finally:
            await codec.close()
        return total

    n = asyncio.run(main())
    assert abs(n - 2048 * 12 * 16000 / 24000) <= 2  # the stream resampler, flushed at the end
