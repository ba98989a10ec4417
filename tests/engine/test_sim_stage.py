"""The simulated GPU stage (engine/stages/sim.py): its timing follows its cost model, its
KV capacity makes extra requests wait, and its outputs have the real stages' shapes."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import numpy as np
import pytest
import yaml

from duplex_contract.batch import AudioOut, ChatMessage, TextOut
from duplex_contract.errors import ConfigError
from engine.codec_layout import ORPHEUS
from engine.config import engine_config, load_engine_config
from engine.messages import AsrRequest, LlmRequest, StageDone, TokensOut, TokensRequest, TtsRequest
from engine.pipeline.graph import build_graph
from engine.stages.sim import SimOptions, SimStage, call_cost_ms, step_cost_ms
from engine.stages.sim_costs import cost_file_of, simulate_config
from engine.stages.sim_plans import reply_of, transcript_of
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


# ----------------------------------------------------------------------------- issue 38
def _pair(device_a: str, device_b: str, step_ms: float = 20.0) -> list[SimStage]:
    opts = SimOptions(role="llm", step_ms=step_ms, reply=" ".join(["w"] * 10))
    return [SimStage(opts, "llm", device=device_a), SimStage(opts, "talker-ish", device=device_b)]


@pytest.mark.parametrize(("b_device", "shared"), [("cuda:0", True), ("cuda:1", False)])
def test_stages_on_one_device_take_turns_and_on_two_run_together(
    b_device: str, shared: bool
) -> None:
    """A step of one stage occupies its device; a stage on the same ``cuda:N`` waits for it
    (time-slicing), a stage on another device does not."""

    async def main() -> None:
        a, b = _pair("cuda:0", b_device)
        for s in (a, b):
            await s.start()
        try:
            t0 = asyncio.get_running_loop().time()
            await asyncio.gather(_timed(a, _llm(0)), _timed(b, _llm(1)))
            took = asyncio.get_running_loop().time() - t0
            assert (a.clock is b.clock) is shared
            spans = sorted((start, end) for s in (a, b) for _, start, end in s.calls)
            overlaps = sum(1 for (_, e0), (s1, _) in itertools.pairwise(spans) if s1 < e0 - 1e-9)
            if shared:  # 20 steps of 20 ms, one after another
                assert overlaps == 0 and took >= 0.4 - 0.02
                assert a.clock is not None and a.clock.busy_s == pytest.approx(0.4, abs=1e-6)
                # they alternated: neither ran all its steps first
                owners = [name for name, _, _ in sorted(a.clock.spans, key=lambda x: x[1])]
                assert owners[:4] != [owners[0]] * 4
            else:  # 10 steps each, side by side
                assert overlaps >= 5 and took < 0.4
        finally:
            for s in (a, b):
                await s.close()

    run(main())


def test_a_cpu_placed_sim_stage_has_a_device_of_its_own() -> None:
    async def main() -> None:
        a, b = _pair("cpu", "cpu")
        for s in (a, b):
            await s.start()
        try:
            assert a.clock is not None and b.clock is not None and a.clock is not b.clock
        finally:
            for s in (a, b):
                await s.close()

    run(main())


def test_costs_come_from_the_cost_file_unless_the_config_sets_them(tmp_path: Any) -> None:
    talker = SimStage(SimOptions(cost_file="configs/sim/h200-costs.yaml"), "talker")
    assert (talker.options.step_ms, talker.options.step_ms_per_seq) == (7.0, 0.06)
    mine = SimStage(SimOptions(cost_file="configs/sim/h200-costs.yaml", step_ms=3.0), "talker")
    assert (mine.options.step_ms, mine.options.step_ms_per_seq) == (3.0, 0.06)
    codec = SimStage(SimOptions(cost_file="configs/sim/h200-costs.yaml"), "codec")
    assert codec.options.call_ms_at == {1: 3.4, 8: 6.3, 32: 18.5, 128: 69.0}
    with pytest.raises(ConfigError, match=r"options\.cost_key: .* has no stage 'nope'"):
        SimStage(SimOptions(cost_file="configs/sim/h200-costs.yaml", cost_key="nope"), "llm")
    bad = tmp_path / "bad.yaml"
    bad.write_text("device: {name: x, memory_gib: 1}\nstages: {llm: {step_ms: -1}}\n")
    with pytest.raises(ConfigError, match="cost_file"):
        SimStage(SimOptions(cost_file=str(bad)), "llm")


def test_a_deployable_config_swaps_to_the_sim_keeping_its_shape() -> None:
    raw = yaml.safe_load((ROOT / "configs" / "gpu-talker.yaml").read_text())["engine"]
    costs = cost_file_of(ROOT / "configs" / "sim-h200.yaml")
    assert costs.name == "h200-costs.yaml"
    sim = simulate_config(raw, costs)
    assert sim["routes"] == raw["routes"] and sim["scheduling"] == raw["scheduling"]
    graph = build_graph(engine_config(sim))
    stages = {name: reps[0] for name, reps in graph.replicas.items()}
    assert all(isinstance(s, SimStage) and s.device == "cuda:0" for s in stages.values())
    talker, codec, llm = stages["talker"], stages["codec"], stages["llm"]
    assert isinstance(talker, SimStage) and isinstance(codec, SimStage)
    assert isinstance(llm, SimStage)
    t = raw["stages"]["talker"]["options"]
    assert (talker.capacity, talker.options.max_frames) == (t["max_num_seqs"], t["max_frames"])
    c = raw["stages"]["codec"]["options"]
    assert (codec.options.first_frames, codec.options.window_frames) == (
        c["first_frames"],
        c["window_frames"],
    )
    # KV from the memory share: 0.45 x 131 GiB less 6.1 GiB of weights, 112 KiB a token
    assert talker.options.kv_tokens == int((0.45 * 131 - 6.1) * 2**30 / 114688)
    assert llm.options.reply is None and stages["asr"].options.transcript is None  # type: ignore[union-attr]


def test_what_the_sim_hears_and_says_depends_on_its_input() -> None:
    audio = (np.sin(np.arange(16000) / 7.0) * 8000).astype("<i2").tobytes()  # 1 s
    whole = transcript_of(audio, 16000, 2.5)
    half = transcript_of(audio[: len(audio) // 2], 16000, 2.5)
    assert whole == transcript_of(audio, 16000, 2.5)  # deterministic
    assert (len(whole.split()), len(half.split())) == (2, 1)  # 2.5 words a second
    a, b = reply_of("what time is it", (12, 28)), reply_of("where is the station", (12, 28))
    assert a != b and 12 <= len(a) <= 28 and a[-1].endswith(".")


def test_a_sim_decode_stage_reports_its_pace() -> None:
    async def main() -> None:
        stage = await _started("talker", step_ms=10.0, ms_per_word=330.0)
        try:
            assert stage.pace() is None  # nothing running
            task = asyncio.create_task(_timed(stage, TtsRequest(request_id="s/t", text="a b c")))
            await asyncio.sleep(0.2)
            pace = stage.pace()
            assert pace is not None and pace.streams == 1
            assert pace.rate == pytest.approx(100.0, rel=0.2)  # one token per 10 ms step
            assert pace.need == pytest.approx(1000 / ORPHEUS.frame_ms * 7)
            await task
        finally:
            await stage.close()

    run(main())


def test_a_sim_codec_gathers_windows_into_one_call() -> None:
    async def main() -> None:
        stage = await _started("codec", call_ms=3.0, gather_ms=40.0)
        try:

            def window(i: int) -> TokensRequest:
                ids = tuple(range(7 * 5))
                return TokensRequest(request_id=f"s{i}/codec0", ids=ids, context=0, final=True)

            t0 = asyncio.get_running_loop().time()
            first = asyncio.create_task(_timed(stage, window(0)))
            await asyncio.sleep(0.01)
            await asyncio.gather(first, _timed(stage, window(1)))
            assert [n for n, _, _ in stage.calls] == [2]  # one call for both
            _, start, _ = stage.calls[0]
            assert start - t0 >= 0.04 - 0.005  # after the gather window
        finally:
            await stage.close()

    run(main())
