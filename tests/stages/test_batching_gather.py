"""The batching runtime's gather window (engine/stages/batching.py ``gather_s``; the SNAC
codec's ``gather_ms``): an idle runtime waits that long after a request arrives, so requests
arriving meanwhile share its step (fewer, fuller calls on a GPU that other stages share)."""

from __future__ import annotations

import asyncio

import pytest

from engine.messages import AsrRequest
from engine.stages.testing import TestStageOptions
from engine.stages.testing_batch import BatchTestStage
from tests.engine.conftest import run


async def _transcribe(stage: BatchTestStage, rid: str) -> None:
    async for _ in stage.submit(AsrRequest(request_id=rid, audio=b"\0\0" * 1600)):
        pass


@pytest.mark.parametrize(("gather_s", "together"), [(0.0, False), (0.2, True)])
def test_requests_that_arrive_within_the_gather_window_share_a_step(
    gather_s: float, together: bool
) -> None:
    async def main() -> None:
        stage = BatchTestStage(TestStageOptions(role="asr", step_s=0.05), "asr")
        stage.runtime.gather_s = gather_s
        await stage.start()
        try:
            first = asyncio.create_task(_transcribe(stage, "a"))
            await asyncio.sleep(0.02)
            await asyncio.gather(first, _transcribe(stage, "b"))
            assert (stage.batches[0] == ("a", "b")) is together, stage.batches
        finally:
            await stage.close()

    run(main())


def test_the_snac_codec_takes_its_gather_window_from_its_options() -> None:
    from engine.stages.codec_snac import CodecSnacOptions, SnacCodec

    codec = SnacCodec(CodecSnacOptions(gather_ms=40, max_batch=8), "codec")
    assert codec.runtime.gather_s == pytest.approx(0.04)
