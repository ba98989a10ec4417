"""The batching stage runtime on the deterministic batched test stage, and through the engine."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from duplex_contract.batch import AudioOut, ChatMessage, TextOut
from duplex_contract.control import AppendCall, CommitCall, OpenCall, SignalCall
from duplex_contract.errors import StageError
from duplex_contract.session_events import AudioChunk, ResponseDone
from duplex_contract.settings import SessionSettings
from engine.config import engine_config
from engine.messages import LlmRequest, Priority, StageDone, StageOutput, TtsRequest
from engine.stages.batching import BatchSlot
from engine.stages.testing import TestStage, TestStageOptions, frame_pcm, word_frame
from engine.stages.testing_batch import BatchTestStage
from tests.engine.conftest import UNIT, collect, open_engine, run
from tests.engine.test_orchestrator import text_turn


def llm_req(rid: str, text: str = "hi", priority: Priority = Priority.REALTIME) -> LlmRequest:
    return LlmRequest(
        request_id=rid,
        messages=(ChatMessage(role="user", content=text),),
        max_tokens=64,
        priority=priority,
        session_id=rid.split("/")[0],
    )


async def drain(stage: Any, req: Any) -> list[StageOutput]:
    return [out async for out in stage.submit(req)]


def started(role: str, **opts: Any) -> BatchTestStage:
    return BatchTestStage(TestStageOptions(role=role, **opts), role)  # type: ignore[arg-type]


def test_concurrent_requests_share_steps() -> None:
    async def main() -> None:
        stage = started("tts", step_s=0.01, ms_per_word=100.0, chunk_ms=20.0, max_batch=8)
        await stage.start()
        try:
            reqs = [
                TtsRequest(request_id=f"s{i}/e0/t0/r0/tts0", text="two words", session_id=f"s{i}")
                for i in range(8)
            ]
            outs = await asyncio.gather(*(drain(stage, r) for r in reqs))
            items = 0
            for out in outs:
                audio = [o for o in out if isinstance(o, AudioOut)]
                assert len(audio) == 10  # 200 ms in 20 ms chunks, one per step
                assert isinstance(out[-1], StageDone) and out[-1].finish_reason == "stop"
                items += len(audio)
            assert stage.runtime.items_stepped >= items
            assert stage.runtime.steps < items / 4  # 80 chunks in far fewer steps
            assert stage.runtime.max_step_size == 8
        finally:
            await stage.close()

    run(main())


def test_abort_mid_batch_emits_nothing_after_and_frees_the_slot() -> None:
    async def main() -> None:
        stage = started("llm", step_s=0.01, reply=" ".join(["word"] * 40))
        await stage.start()
        try:
            keep = asyncio.create_task(drain(stage, llm_req("a/e0/t0/r0/llm")))
            got: list[StageOutput] = []
            victim = llm_req("b/e0/t0/r0/llm")
            steps_at_abort = 0

            async def consume() -> None:
                nonlocal steps_at_abort
                async for out in stage.submit(victim):
                    got.append(out)
                    if len(got) == 3:
                        await stage.abort([victim.request_id])
                        steps_at_abort = stage.runtime.steps

            await asyncio.wait_for(consume(), 5 * UNIT)
            text = [o for o in got if isinstance(o, TextOut)]
            assert len(text) == 3  # nothing after the abort
            assert isinstance(got[-1], StageDone) and got[-1].finish_reason == "aborted"
            await asyncio.sleep(0.05)
            # the slot is gone: later steps hold only the other request
            later = stage.batches[steps_at_abort + 1 :]
            assert later and all(b == ("a/e0/t0/r0/llm",) for b in later)
            out = await asyncio.wait_for(keep, 5 * UNIT)
            assert len([o for o in out if isinstance(o, TextOut)]) == 40
        finally:
            await stage.close()

    run(main())


def test_a_failing_item_fails_only_its_request() -> None:
    async def main() -> None:
        stage = started("llm", step_s=0.005, fail_on="explode")
        await stage.start()
        try:
            reqs = [llm_req(f"s{i}/e0/t0/r0/llm", "explode" if i == 2 else "hi") for i in range(4)]
            results = await asyncio.gather(*(drain(stage, r) for r in reqs), return_exceptions=True)
            assert isinstance(results[2], StageError) and results[2].code == "stage_failed"
            for i in (0, 1, 3):
                res = results[i]
                assert isinstance(res, list) and isinstance(res[-1], StageDone)
        finally:
            await stage.close()

    run(main())


class RaisingStep(BatchTestStage):
    """A backend whose batched step raises as a whole when one item is bad."""

    def step(self, batch: Sequence[BatchSlot]) -> None:
        if any("poison" in self._text(s.request) for s in batch):
            raise RuntimeError("the batch cannot be computed")
        super().step(batch)


def test_a_step_that_raises_is_isolated_and_nothing_is_emitted_twice() -> None:
    async def main() -> None:
        stage = RaisingStep(TestStageOptions(role="llm", step_s=0.01, reply="one two three"), "llm")
        await stage.start()
        try:
            good = [llm_req(f"s{i}/e0/t0/r0/llm") for i in range(3)]
            bad = llm_req("x/e0/t0/r0/llm", "poison")
            results = await asyncio.gather(
                *(drain(stage, r) for r in [*good, bad]), return_exceptions=True
            )
            assert isinstance(results[3], StageError)
            assert "the batch cannot be computed" in str(results[3])
            for res in results[:3]:
                assert isinstance(res, list)
                assert "".join(o.text for o in res if isinstance(o, TextOut)) == "one two three"
        finally:
            await stage.close()

    run(main())


def test_realtime_items_are_taken_before_batch_items() -> None:
    async def main() -> None:
        stage = started("llm", step_s=0.01, reply="a b c d e f", max_batch=2)
        await stage.start()
        try:
            batch = [llm_req(f"b{i}/e0/t0/r0/llm", priority=Priority.BATCH) for i in range(3)]
            tasks = [asyncio.create_task(drain(stage, r)) for r in batch]
            await asyncio.sleep(0.03)  # batch work is running
            rt = [llm_req(f"r{i}/e0/t0/r0/llm") for i in range(2)]
            await asyncio.gather(*(drain(stage, r) for r in rt))
            await asyncio.gather(*tasks)
            steps = stage.batches
            first_rt = next(i for i, b in enumerate(steps) if any(r.startswith("r") for r in b))
            last_rt = max(i for i, b in enumerate(steps) if any(r.startswith("r") for r in b))
            assert first_rt > 0  # batch work had started
            # from the moment real-time work joined, each step was all real-time until done
            for b in steps[first_rt : last_rt + 1]:
                assert all(r.startswith("r") for r in b), steps
            assert all(len(b) <= 2 for b in steps)
        finally:
            await stage.close()

    run(main())


def test_a_committed_turn_goes_before_speculative_guesses() -> None:
    """Guesses (ASR at a pause, Priority.SPECULATIVE) queued on a busy stage: a committed
    turn's request that joins after them runs at the next step, ahead of all of them."""

    async def main() -> None:
        stage = started("llm", step_s=0.01, reply="a b c d e f", max_batch=1)
        await stage.start()
        try:
            guesses = [
                llm_req(f"g{i}/e0/t0/r0/llm", priority=Priority.SPECULATIVE) for i in range(3)
            ]
            tasks = [asyncio.create_task(drain(stage, r)) for r in guesses]
            await asyncio.sleep(0.03)  # the first guess is running
            await drain(stage, llm_req("t0/e0/t0/r0/llm"))
            await asyncio.gather(*tasks)
            steps = [b[0] for b in stage.batches]
            first = steps.index("t0/e0/t0/r0/llm")
            last = len(steps) - 1 - steps[::-1].index("t0/e0/t0/r0/llm")
            assert first > 0  # a guess had started
            assert set(steps[first : last + 1]) == {"t0/e0/t0/r0/llm"}, steps
            assert not any(s.startswith(("g1", "g2")) for s in steps[:first]), steps
        finally:
            await stage.close()

    run(main())


def test_worker_crash_fails_its_requests_and_the_worker_restarts() -> None:
    async def main() -> None:
        stage = started("llm", step_s=0.005, crash_on="die")
        await stage.start()
        try:
            res = await asyncio.gather(
                drain(stage, llm_req("a/e0/t0/r0/llm", "die")),
                drain(stage, llm_req("b/e0/t0/r0/llm")),
                return_exceptions=True,
            )
            assert any(isinstance(r, StageError) and r.code == "worker_died" for r in res)
            for _ in range(100):
                if stage.restarts == 1 and stage.runtime.worker.alive:
                    break
                await asyncio.sleep(0.02)
            out = await asyncio.wait_for(drain(stage, llm_req("c/e0/t0/r0/llm")), 5 * UNIT)
            assert isinstance(out[-1], StageDone) and out[-1].finish_reason == "stop"
        finally:
            await stage.close()

    run(main())


def test_close_ends_every_request_in_flight() -> None:
    async def main() -> None:
        stage = started("llm", step_s=0.01, hang_on="forever")
        await stage.start()
        running = asyncio.create_task(drain(stage, llm_req("a/e0/t0/r0/llm", "forever")))
        await asyncio.sleep(0.05)
        await stage.close()
        out = await asyncio.wait_for(running, 5 * UNIT)
        assert isinstance(out[-1], StageDone) and out[-1].finish_reason == "aborted"
        assert not stage.runtime.worker.alive

    run(main())


# ----------------------------------------------------------------------------- via the engine
@pytest.mark.usefixtures("transport")
def test_sessions_on_batched_stages_share_steps_and_barge_in_still_aborts() -> None:
    from duplex_contract.fence import Fence

    async def main() -> None:
        o = TestStageOptions(step_s=0.01, chunk_ms=20.0, reply="one two three four five six")
        backends: dict[str, Any] = {
            "asr": [BatchTestStage(o, "asr")],
            "llm": [BatchTestStage(o, "llm")],
            "tts": [BatchTestStage(o, "tts")],
        }
        cfg = engine_config(
            {
                "stages": {n: {"backend": "test-batch"} for n in ("asr", "llm", "tts")},
                "routes": {"voice": ["asr", "llm", "tts"]},
            }
        )
        engine = await open_engine(cfg, backends)
        try:
            turns = await asyncio.gather(*(text_turn(engine, f"hello {i}") for i in range(6)))
            dones = await asyncio.gather(
                *(
                    collect(engine, sid, lambda e: isinstance(e, ResponseDone), 10 * UNIT)
                    for sid, _, _ in turns
                )
            )
            for events in dones:
                done = events[-1]
                assert isinstance(done, ResponseDone) and done.status == "completed"
                assert any(isinstance(e, AudioChunk) for e in events)
            assert backends["llm"][0].runtime.max_step_size > 1  # sessions decoded together
            assert backends["tts"][0].runtime.max_step_size > 1
            # a barge-in on a batched stage still aborts the old epoch everywhere
            sid, fence, gen = await text_turn(engine, "again")
            async for ev in engine.session_events(sid):
                if isinstance(ev, AudioChunk):
                    break
            nxt = Fence(sid, fence.epoch + 1, fence.turn_id, fence.response_seq)
            await engine.call(
                SignalCall(fence=fence, lease_generation=gen, event="barge_in", next_fence=nxt)
            )
            tail = await collect(engine, sid, lambda e: isinstance(e, ResponseDone))
            assert isinstance(tail[-1], ResponseDone) and tail[-1].status == "cancelled"
            assert not any(isinstance(e, AudioChunk) for e in tail[:-1] if e.fence != fence)
            await asyncio.sleep(0.1)
            for stage in backends.values():
                assert not [
                    r for r in stage[0].runtime.running() if r.request_id.startswith(fence.key())
                ]
        finally:
            await engine.shutdown()

    run(main())


@pytest.mark.usefixtures("transport")
def test_a_talker_and_codec_route_streams_codec_frames_into_audio() -> None:
    """thinker -> talker (codec frames) -> codec (audio), all declared in config."""

    async def main() -> None:
        reply = "Hello there. This is the talker speaking now."
        o = TestStageOptions(reply=reply, ms_per_frame=40.0, transcript="hi")
        cfg = engine_config(
            {
                "stages": {
                    "asr": {"backend": "test"},
                    "thinker": {"backend": "test", "options": {"role": "llm"}},
                    "talker": {"backend": "test"},
                    "code2wav": {"backend": "test", "options": {"role": "codec"}},
                },
                "routes": {"voice": ["asr", "thinker", "talker", "code2wav"]},
            }
        )
        backends = {
            "asr": [TestStage(o, "asr")],
            "thinker": [TestStage(o, "thinker", stage="llm")],
            "talker": [TestStage(o, "talker")],
            "code2wav": [TestStage(o, "code2wav", stage="codec")],
        }
        engine = await open_engine(cfg, backends)
        try:
            res = await engine.call(OpenCall(config=SessionSettings(output_modalities=("audio",))))
            assert res.session_id and res.accepted_fence
            await engine.call(
                AppendCall(fence=res.accepted_fence, lease_generation=1, text="speak")
            )
            await engine.call(CommitCall(fence=res.accepted_fence, lease_generation=1))
            events = await collect(
                engine, res.session_id, lambda e: isinstance(e, ResponseDone), 10 * UNIT
            )
            done = events[-1]
            assert isinstance(done, ResponseDone) and done.status == "completed"
            chunks = [e for e in events if isinstance(e, AudioChunk)]
            # windows with left context joined = a one-shot decode of every frame
            frames = [word_frame(w, o.frame_size) for w in reply.split()]
            one_shot = b"".join(frame_pcm(f, 24000, o.ms_per_frame) for f in frames)
            joined = b"".join(c.pcm for c in chunks)
            assert joined == one_shot
            assert len(chunks) > 2  # streamed in several windows, not one
            starts = [c.audio_start_ms for c in chunks]
            assert starts == sorted(starts) and starts[0] == 0.0
            assert np.isclose(done.audio_ms, len(frames) * o.ms_per_frame)
            marks = "".join(c.text for c in chunks)
            assert "Hello" in marks and "talker" in marks  # marks follow the segments
        finally:
            await engine.shutdown()

    run(main())


def test_the_test_stages_keep_a_bounded_record(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the test stages record for tests (request ids, priorities, steps) is bounded: a
    soak's server runs them for hours, and these records grew its memory ~60 MB/h."""
    import engine.stages.testing as testing
    import engine.stages.testing_batch as testing_batch

    monkeypatch.setattr(testing, "KEEP_IDS", 8)
    monkeypatch.setattr(testing_batch, "KEEP_IDS", 8)

    async def main() -> None:
        plain = TestStage(TestStageOptions(), "llm")
        batching = started("llm", max_batch=1)
        await plain.start()
        await batching.start()
        try:
            for i in range(20):
                await drain(plain, llm_req(f"s{i}/e0/t0/r0/llm"))
                await drain(batching, llm_req(f"s{i}/e0/t0/r0/llm"))
        finally:
            await batching.close()
            await plain.close()
        assert 4 <= len(plain.submitted) <= 8 and plain.submitted[-1] == "s19/e0/t0/r0/llm"
        assert set(plain.priorities) == set(plain.submitted)
        assert 4 <= len(batching.batches) <= 8
        assert batching.batches[-1] == ("s19/e0/t0/r0/llm",)

    run(main())
