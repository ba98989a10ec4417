"""The simulated GPU stage (engine/stages/sim.py): its timing follows its cost model, its
KV capacity makes extra requests wait, and its outputs have the real stages' shapes."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from duplex_contract.batch import AudioOut, ChatMessage, TextOut
from engine.codec_layout import ORPHEUS
from engine.config import load_engine_config
from engine.messages import AsrRequest, LlmRequest, StageDone, TokensOut, TokensRequest, TtsRequest
from engine.pipeline.graph import build_graph
from engine.stages.sim import SimOptions, SimStage, call_cost_ms, step_cost_ms
from tests.engine.conftest import ROOT, run


async def _started(role: str, **opts: Any) -> SimStage:
    stage = SimStage(SimOptions(role=role, **opts), role)  # type: ignore[arg-type]
    await stage.start()
    return stage


async def _timed(stage: SimStage, req: Any) -> list[tuple[float, Any]]:
    loop = asyncio.get_running_loop()
    return [(loop.time(), out) async for out in stage.submit(req)]


def _llm(i: int, words: int = 2) -> LlmRequest:
    content = " ".join(["word"] * words)
    return LlmRequest(request_id=f"s{i}/llm", messages=(ChatMessage(role="user", content=content),))


def test_cost_curves() -> None:
    codec = SimOptions(call_ms_at={1: 3.4, 8: 6.3, 32: 18.5, 128: 69.0})
    assert call_cost_ms(codec, 1) == pytest.approx(3.4)
    assert call_cost_ms(codec, 8) == pytest.approx(6.3)
    assert call_cost_ms(codec, 20) == pytest.approx(6.3 + 12.2 * 12 / 24)
    assert call_cost_ms(codec, 256) == pytest.approx(69.0 + 50.5 * 128 / 96)
    assert call_cost_ms(SimOptions(call_ms=40, item_ms=8), 3) == pytest.approx(64.0)
    talker = SimOptions(step_ms=7, step_ms_per_seq=0.06, prefill_ms_per_token=0.05)
    assert step_cost_ms(talker, 100) == pytest.approx(13.0)
    assert step_cost_ms(talker, 1, prefill_tokens=200) == pytest.approx(17.06)


@pytest.mark.parametrize("batch", [1, 6])
def test_a_decode_step_at_batch_n_takes_a_plus_b_n(batch: int) -> None:
    async def main() -> None:
        a, b, tokens = 20.0, 6.0, 8
        stage = await _started("llm", step_ms=a, step_ms_per_seq=b, reply=" ".join(["w"] * tokens))
        try:
            outs = await asyncio.gather(*(_timed(stage, _llm(i)) for i in range(batch)))
            for timed in outs:
                texts = [t for t, o in timed if isinstance(o, TextOut)]
                assert len(texts) == tokens
                per_step = (texts[-1] - texts[0]) / (tokens - 1) * 1000
                # measured on the loop clock: a loaded machine wakes the loop late, and the
                # stage's running deadline catches up, so the mean step stays near the model
                assert per_step == pytest.approx(a + b * batch, rel=0.3)
            assert {n for n, _, _ in stage.calls} == {batch}
            for _, start, end in stage.calls:  # the model's own clock: exact
                assert (end - start) * 1000 == pytest.approx(a + b * batch, abs=1e-6)
        finally:
            await stage.close()

    run(main())


def test_kv_capacity_makes_the_extra_request_wait() -> None:
    async def main() -> None:
        # each request: prompt ceil(len("word word")/4) + 4 = 7 tokens, plus 5 of reply
        stage = await _started("llm", step_ms=10.0, reply="a b c d e", kv_tokens=15)
        try:
            first, second = await asyncio.gather(_timed(stage, _llm(0)), _timed(stage, _llm(1)))
            end_first = first[-1][0]
            start_second = next(t for t, o in second if isinstance(o, TextOut))
            assert start_second >= end_first - 0.002  # it joined only once the first left
            assert {n for n, _, _ in stage.calls} == {1}
            assert stage.kv_used == 0
            # with room for both they share steps
            roomy = await _started("llm", step_ms=10.0, reply="a b c d e", kv_tokens=24)
            try:
                await asyncio.gather(_timed(roomy, _llm(0)), _timed(roomy, _llm(1)))
                assert {n for n, _, _ in roomy.calls} == {2}
            finally:
                await roomy.close()
        finally:
            await stage.close()

    run(main())


def test_batched_calls_take_their_cost_and_real_time_goes_first() -> None:
    async def main() -> None:
        stage = await _started("asr", call_ms=40.0, item_ms=8.0, max_batch=3)
        try:
            reqs = [AsrRequest(request_id=f"a{i}", audio=b"\0\0" * 160) for i in range(5)]
            outs = await asyncio.gather(*(_timed(stage, r) for r in reqs))
            sizes = [n for n, _, _ in stage.calls]
            assert sizes == [3, 2]
            for (_n, start, end), want in zip(stage.calls, (64.0, 56.0), strict=True):
                assert (end - start) * 1000 == pytest.approx(want, rel=0.01)
            assert all(o[0][1].text == SimOptions().transcript for o in outs)
        finally:
            await stage.close()

    run(main())


def test_talker_and_codec_speak_real_shaped_frames_and_audio() -> None:
    async def main() -> None:
        talker = await _started("talker", step_ms=1.0, ms_per_word=256.0)
        codec = await _started("codec", call_ms=1.0)
        try:
            req = TtsRequest(request_id="s/talker0", text="one two three")  # 768 ms: 9 frames
            outs = [o async for o in talker.submit(req)]
            codes = [c for o in outs if isinstance(o, TokensOut) for c in o.ids]
            assert len(codes) == 9 * ORPHEUS.frame_size
            ORPHEUS.split(codes)  # whole frames, every code in its codebook's range
            assert isinstance(outs[-1], StageDone)
            chunker = codec.make_chunker()
            assert chunker is not None
            windows = chunker.push(TokensOut(request_id="s/talker0", ids=tuple(codes)))
            windows += chunker.flush()
            pcm = b""
            for i, w in enumerate(windows):
                r = TokensRequest(
                    request_id=f"s/codec{i}",
                    ids=w.ids,
                    context=w.context,
                    final=w.final,
                    sample_rate=24000,
                )
                pcm += b"".join([o.pcm async for o in codec.submit(r) if isinstance(o, AudioOut)])
            assert len(pcm) == 2 * 9 * ORPHEUS.samples_per_frame  # every frame once
        finally:
            await talker.close()
            await codec.close()

    run(main())


def test_abort_ends_the_stream_and_frees_the_kv() -> None:
    async def main() -> None:
        stage = await _started("llm", step_ms=20.0, reply=" ".join(["w"] * 50))
        try:
            got: list[Any] = []

            async def consume() -> None:
                async for out in stage.submit(_llm(0)):
                    got.append(out)

            task = asyncio.create_task(consume())
            await asyncio.sleep(0.1)
            await stage.abort(["s0/llm"])
            await asyncio.wait_for(task, 1.0)
            assert isinstance(got[-1], StageDone) and got[-1].finish_reason == "aborted"
            assert stage.kv_used == 0 and len(got) < 50
        finally:
            await stage.close()

    run(main())


def test_the_sim_config_builds() -> None:
    cfg = load_engine_config(ROOT / "configs" / "sim-h200.yaml")
    graph = build_graph(cfg)
    assert [s.name for s in graph.route("voice").stages] == ["asr", "llm", "talker", "codec"]
    assert cfg.scheduling.policy == "capacity"
