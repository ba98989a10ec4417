"""The talker route in the engine with the real SNAC codec stage (the talker is the test role,
so no vLLM start): sessions share codec decode calls; the speech route speaks through it."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from duplex_contract.batch import AudioOut, BatchDone, SpeechJob
from duplex_contract.control import AppendCall, CommitCall, OpenCall
from duplex_contract.session_events import AudioChunk, ResponseDone
from duplex_contract.settings import SessionSettings
from engine.api.client import AsyncEngine
from engine.config import engine_config
from engine.stages.codec_snac import CodecSnacOptions, SnacCodec
from engine.stages.testing import TestStage, TestStageOptions
from tests.engine.conftest import UNIT, collect

pytestmark = pytest.mark.vllm

REPLY = " ".join(f"word{i}" for i in range(36)) + "."
CODEC = CodecSnacOptions(config={"decoder_dim": 64}, threads=2, window_frames=4, max_batch=8)


def talker_engine_config() -> object:
    return engine_config(
        {
            "stages": {
                "asr": {"backend": "test"},
                "llm": {"backend": "test"},
                "talker": {"backend": "test"},
                "codec": {"backend": "snac"},
            },
            "routes": {
                "voice": ["asr", "llm", "talker", "codec"],
                "speech": ["talker", "codec"],
            },
        }
    )


def test_two_sessions_share_codec_decode_calls_and_speech_uses_the_route() -> None:
    async def main() -> None:
        # frames come at 50 ms per word, so both sessions stream at once for a while
        o = TestStageOptions(reply=REPLY, transcript="hi", token_interval_s=0.05)
        codec = SnacCodec(CODEC, "codec")
        backends = {
            "asr": [TestStage(o, "asr")],
            "llm": [TestStage(o, "llm")],
            "talker": [TestStage(o, "talker")],
            "codec": [codec],
        }
        engine = await AsyncEngine.start(talker_engine_config(), backends)  # type: ignore[arg-type]
        try:
            opened = [
                await engine.call(OpenCall(config=SessionSettings(output_modalities=("audio",))))
                for _ in "ab"
            ]
            for res in opened:
                assert res.accepted_fence is not None
                await engine.call(
                    AppendCall(fence=res.accepted_fence, lease_generation=1, text="speak")
                )
            for res in opened:
                assert res.accepted_fence is not None
                await engine.call(CommitCall(fence=res.accepted_fence, lease_generation=1))
            runs = await asyncio.gather(
                *(
                    collect(
                        engine, str(r.session_id), lambda e: isinstance(e, ResponseDone), 60 * UNIT
                    )
                    for r in opened
                )
            )
            for events in runs:
                done = events[-1]
                assert isinstance(done, ResponseDone) and done.status == "completed", done
                pcm = b"".join(e.pcm for e in events if isinstance(e, AudioChunk))
                # one frame per word, 2048 samples per frame at 24 kHz
                assert len(pcm) // 2 == 2048 * len(REPLY.split())
                assert np.abs(np.frombuffer(pcm, dtype=np.int16)).max() > 0
            # The runtime's own counters: some step decoded both sessions' windows at once.
            assert codec.runtime.max_step_size >= 2
            assert codec.decoder.decode_calls < codec.decoder.rows_decoded
            # The batch speech endpoint's route: [talker, codec].
            items = [
                i async for i in engine.generate(SpeechJob(text="one two three four five six"))
            ]
            audio = [i for i in items if isinstance(i, AudioOut)]
            assert isinstance(items[-1], BatchDone) and audio
            assert sum(len(a.pcm) for a in audio) // 2 == 2048 * 6
        finally:
            await engine.shutdown()

    asyncio.run(main())
