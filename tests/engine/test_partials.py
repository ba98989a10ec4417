"""Live partial transcripts (real pocketsphinx) while whisper-style finals come at commit."""

from __future__ import annotations

import asyncio

import msgspec
import numpy as np
import pytest
import soundfile as sf
import soxr

from duplex_contract.control import AppendCall, CommitCall, OpenCall
from duplex_contract.session_events import ResponseDone, UserTranscript
from engine.config import PartialsConfig
from tests.engine.conftest import ROOT, UNIT, collect, make_config, open_engine, run, stages

pytestmark = [pytest.mark.models, pytest.mark.usefixtures("transport")]


def beckett_16k() -> bytes:
    data, rate = sf.read(ROOT / "tests" / "data" / "beckett.wav", dtype="float32")
    if data.ndim > 1:
        data = data.mean(axis=1)
    data = soxr.resample(data, rate, 16000)
    return (np.clip(data, -1, 1) * 32767).astype(np.int16).tobytes()


def test_partials_stream_while_appending_then_final_at_commit() -> None:
    async def main() -> None:
        cfg = make_config()
        cfg = msgspec.structs.replace(cfg, partials=PartialsConfig(backend="pocketsphinx"))
        engine = await open_engine(cfg, stages())
        try:
            res = await engine.call(OpenCall())
            sid, f, gen = res.session_id, res.accepted_fence, res.lease_generation
            assert sid and f
            pcm = beckett_16k()[: 16000 * 2 * 4]  # the first 4 s
            for i in range(0, len(pcm), 640):
                await engine.call(AppendCall(fence=f, lease_generation=gen, audio=pcm[i : i + 640]))
            partials: list[str] = []

            async def watch() -> None:
                async for ev in engine.session_events(sid):
                    if isinstance(ev, UserTranscript):
                        assert not ev.final and ev.fence == f
                        partials.append(ev.text)

            watcher = asyncio.create_task(watch())
            for _ in range(100):
                if partials:
                    break
                await asyncio.sleep(0.05 * UNIT)
            watcher.cancel()
            assert partials and all(p.strip() for p in partials)
            await engine.call(CommitCall(fence=f, lease_generation=gen))
            evs = await collect(engine, sid, lambda e: isinstance(e, ResponseDone), 10 * UNIT)
            finals = [e for e in evs if isinstance(e, UserTranscript) and e.final]
            assert len(finals) == 1 and finals[0].fence.turn_id == 1
            late = [e for e in evs if isinstance(e, UserTranscript) and not e.final]
            assert all(e.fence.turn_id == 0 for e in late)
        finally:
            await engine.shutdown()

    run(main())
