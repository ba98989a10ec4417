"""The talker stage on vLLM with the tiny Orpheus-layout talker (random weights): frames are
well-formed whatever the weights, voices change the prompt, an abort leaves vLLM at once."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from duplex_contract.errors import ConfigError
from engine.messages import StageDone, StageOutput, TokensOut, TtsRequest
from engine.stages.talker_vllm import TalkerOptions, VllmTalker, VoiceSampling

pytestmark = pytest.mark.vllm

FRAMES = 8
OPTIONS = TalkerOptions(
    dtype="bfloat16",
    max_model_len=1024,
    kv_cache_memory_gib=0.25,
    max_num_seqs=8,
    enforce_eager=True,
    temperature=1.0,
    top_p=1.0,
    repetition_penalty=1.0,
    max_frames=FRAMES,
    voices={"leo": VoiceSampling(temperature=0.8)},
)


@pytest.fixture(scope="module")
def talker() -> Iterator[VllmTalker]:
    backend = VllmTalker(OPTIONS, "talker")
    asyncio.run(backend.start())
    print(f"\ntiny talker started in {backend.engine.start_s:.1f} s")
    try:
        yield backend
    finally:
        asyncio.run(backend.close())


async def speak(talker: VllmTalker, rid: str, voice: str | None = None) -> list[StageOutput]:
    req = TtsRequest(request_id=rid, text="Hello there, friend.", voice=voice)
    return [out async for out in talker.submit(req)]


def codes_of(outs: list[StageOutput]) -> list[int]:
    return [c for o in outs if isinstance(o, TokensOut) for c in o.ids]


def test_random_weights_speak_whole_in_range_frames_and_voices_differ(talker: VllmTalker) -> None:
    async def main() -> list[list[StageOutput]]:
        return [
            await speak(talker, "s/e0/t1/r1/talker0", "tara"),
            await speak(talker, "s/e0/t1/r1/talker0", "tara"),
            await speak(talker, "s/e0/t1/r1/talker0", "leo"),
        ]

    tara, again, leo = asyncio.run(main())
    for outs in (tara, again, leo):
        done = outs[-1]
        assert isinstance(done, StageDone) and done.finish_reason == "length", done
        codes = codes_of(outs)
        # without the frame logits processor, random weights would sample any of 156,940 ids
        # and token_to_code would have failed the request
        assert len(codes) == 7 * FRAMES == done.tokens
        assert all(0 <= c < 4096 for c in codes)
        assert len([o for o in outs if isinstance(o, TokensOut)]) >= 2  # streamed, not at the end
    assert codes_of(tara) == codes_of(again)  # seeded per request id: reproducible
    assert codes_of(tara) != codes_of(leo)  # the voice is in the prompt (and leo's sampling)


def test_abort_ends_the_stream_and_leaves_vllm_within_a_step(talker: VllmTalker) -> None:
    rid = "s/e3/t1/r1/talker0"

    async def main() -> tuple[list[StageOutput], list[str], list[str]]:
        outs: list[StageOutput] = []
        held: list[str] = []
        req = TtsRequest(request_id=rid, text="A much longer clause to speak for a while.")
        async for out in talker.submit(req):
            outs.append(out)
            if isinstance(out, TokensOut) and len(outs) == 1:
                held = await talker.engine.held_request_ids()
                await talker.abort([rid])
        left = await talker.engine.held_request_ids()
        for _ in range(50):
            if rid not in left:
                break
            await asyncio.sleep(0.02)
            left = await talker.engine.held_request_ids()
        return outs, held, left

    outs, held, left = asyncio.run(main())
    assert rid in held  # vLLM held it mid-stream ...
    assert rid not in left  # ... and no longer does
    assert isinstance(outs[-1], StageDone) and outs[-1].finish_reason == "aborted"
    assert sum(isinstance(o, TokensOut) for o in outs) == 1  # nothing after the abort
    assert outs[-1].tokens < 7 * FRAMES


def test_start_up_errors_name_the_talker_stage() -> None:
    bad = VllmTalker(TalkerOptions(model="/nonexistent/orpheus"), "talker0", stage="talker")
    with pytest.raises(ConfigError) as err:
        asyncio.run(bad.start())
    assert str(err.value).startswith("engine.stages.talker.options.model: /nonexistent/orpheus")
