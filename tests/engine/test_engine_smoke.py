from __future__ import annotations

import asyncio
import itertools

import pytest

from duplex_contract.control import AppendCall, CommitCall, OpenCall
from duplex_contract.session_events import (
    AudioChunk,
    ResponseDone,
    ResponseStarted,
    TextDelta,
    UserTranscript,
)
from duplex_contract.settings import SessionSettings
from tests.engine.conftest import collect, run, start_engine

pytestmark = pytest.mark.usefixtures("transport")  # both engine transports


def test_text_turn_streams_text_and_audio() -> None:
    async def main() -> None:
        engine = await start_engine()
        try:
            res = await engine.call(
                OpenCall(config=SessionSettings(output_modalities=("text", "audio")))
            )
            sid, fence, gen = res.session_id, res.accepted_fence, res.lease_generation
            assert sid and fence and gen == 1
            await engine.call(AppendCall(fence=fence, lease_generation=gen, text="hello"))
            res = await engine.call(CommitCall(fence=fence, lease_generation=gen))
            assert res.accepted_fence and res.accepted_fence.turn_id == 1
            evs = await collect(engine, sid, lambda e: isinstance(e, ResponseDone))
            kinds = [type(e).__name__ for e in evs]
            assert kinds[0] == "ResponseStarted", kinds
            done = evs[-1]
            assert isinstance(done, ResponseDone) and done.status == "completed"
            text = "".join(e.text for e in evs if isinstance(e, TextDelta))
            assert text == done.text and text.startswith("Hello there")
            chunks = [e for e in evs if isinstance(e, AudioChunk)]
            assert chunks and chunks[0].audio_start_ms == 0
            for a, b in itertools.pairwise(chunks):
                assert abs(a.audio_start_ms + a.duration_ms - b.audio_start_ms) < 1e-6
            assert done.audio_ms > 0
            assert not any(isinstance(e, UserTranscript) for e in evs)
            assert all(
                isinstance(e, ResponseStarted) or e.fence == res.accepted_fence
                for e in evs
                if hasattr(e, "fence")
            )
        finally:
            await engine.shutdown()
            await engine.shutdown()  # twice is fine
        assert asyncio.all_tasks() == {asyncio.current_task()}  # no task left behind

    run(main())


def test_audio_turn_transcribes_first() -> None:
    async def main() -> None:
        engine = await start_engine()
        try:
            res = await engine.call(OpenCall())
            sid, fence, gen = res.session_id, res.accepted_fence, res.lease_generation
            assert sid and fence
            await engine.call(
                AppendCall(fence=fence, lease_generation=gen, audio=b"\x00\x01" * 1600)
            )
            await engine.call(CommitCall(fence=fence, lease_generation=gen))
            evs = await collect(engine, sid, lambda e: isinstance(e, ResponseDone))
            assert isinstance(evs[0], UserTranscript)
            assert evs[0].text == "what is the weather like today"
            assert isinstance(evs[1], ResponseStarted)
        finally:
            await engine.shutdown()

    run(main())
