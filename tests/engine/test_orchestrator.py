"""Orchestrator behaviour end to end through AsyncEngine, on the deterministic test stage."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence

import numpy as np
import pytest

from duplex_contract.batch import (
    ChatJob,
    ChatMessage,
    SpeechJob,
    TextOut,
    TranscribeJob,
    TranscriptOut,
)
from duplex_contract.control import (
    AppendCall,
    CloseCall,
    CommitCall,
    OpenCall,
    ResumeCall,
    SignalCall,
    TouchCall,
)
from duplex_contract.errors import ControlError, EngineDeadError, StageError
from duplex_contract.fence import Fence
from duplex_contract.session_events import (
    AudioChunk,
    ResponseDone,
    ResponseStarted,
    SessionEvent,
    SessionLifecycle,
    UserTranscript,
)
from duplex_contract.settings import SessionSettings
from engine.api.client import AsyncEngine
from engine.messages import AsrRequest, Priority
from engine.stages.testing import TestStage, TestStageOptions
from tests.engine.conftest import UNIT, collect, run, stages, start_engine

pytestmark = pytest.mark.usefixtures("transport")  # both engine transports

REALTIME = {"realtime": True, "chunk_ms": 20.0, "token_interval_s": 0.001}
#: 0.5 s of a loud tone at 16 kHz, and 0.25 s of the same 20 dB softer (a soft last syllable)
LOUD = (np.sin(np.arange(8000) / 5) * 20000).astype("<i2").tobytes()
SOFT = (np.sin(np.arange(4000) / 5) * 2000).astype("<i2").tobytes()


async def open_session(engine: AsyncEngine) -> tuple[str, Fence, int]:
    """A new session: (its id, its fence, its lease generation)."""
    res = await engine.call(OpenCall())
    assert res.session_id and res.accepted_fence
    return res.session_id, res.accepted_fence, res.lease_generation


async def text_turn(engine: AsyncEngine, text: str = "hello") -> tuple[str, Fence, int]:
    res = await engine.call(OpenCall(config=SessionSettings(output_modalities=("audio",))))
    assert res.session_id and res.accepted_fence
    await engine.call(AppendCall(fence=res.accepted_fence, lease_generation=1, text=text))
    res2 = await engine.call(CommitCall(fence=res.accepted_fence, lease_generation=1))
    assert res2.accepted_fence
    return res.session_id, res2.accepted_fence, 1


def test_barge_in_stops_output_and_aborts_every_stage_request() -> None:
    async def main() -> None:
        backends = stages(**REALTIME)
        engine = await start_engine(backends)
        try:
            sid, fence, gen = await text_turn(engine)
            seen: list[SessionEvent] = []
            async for ev in engine.session_events(sid):
                seen.append(ev)
                if sum(isinstance(e, AudioChunk) for e in seen) == 3:
                    break
            nxt = Fence(sid, fence.epoch + 1, fence.turn_id, fence.response_seq)
            res = await engine.call(
                SignalCall(fence=fence, lease_generation=gen, event="barge_in", next_fence=nxt)
            )
            assert res.accepted_fence == nxt
            tail = await collect(engine, sid, lambda e: isinstance(e, ResponseDone))
            done = tail[-1]
            assert isinstance(done, ResponseDone) and done.status == "cancelled"
            assert done.reason == "turn_detected" and done.fence == fence
            # nothing of the old epoch after the cancelled done, even after waiting
            await engine.call(AppendCall(fence=nxt, lease_generation=gen, text="next"))
            res = await engine.call(CommitCall(fence=nxt, lease_generation=gen))
            later = await collect(engine, sid, lambda e: isinstance(e, ResponseDone), 10 * UNIT)
            assert all(getattr(e, "fence", nxt).epoch == nxt.epoch for e in later)
            assert later[-1].status == "completed"  # type: ignore[union-attr]
            # every stage request of the old fence was aborted (none still running)
            for name in ("llm", "tts"):
                stage = backends[name][0]
                assert isinstance(stage, TestStage)
                assert not [r for r in stage._cancelled if r.startswith(fence.key())]
        finally:
            await engine.shutdown()

    run(main())


def test_stage_failure_fails_only_its_request() -> None:
    async def main() -> None:
        engine = await start_engine(stages(fail_on="explode"))
        try:
            bad, _, _ = await text_turn(engine, "please explode")
            good, _, _ = await text_turn(engine, "fine")
            evs = await collect(engine, bad, lambda e: isinstance(e, ResponseDone))
            done = evs[-1]
            assert isinstance(done, ResponseDone) and done.status == "failed"
            assert done.error and done.error.code == "stage_failed"
            evs = await collect(engine, good, lambda e: isinstance(e, ResponseDone))
            assert evs[-1].status == "completed"  # type: ignore[union-attr]
            # the failed session stays usable
            r = await engine.call(
                AppendCall(fence=Fence(bad, 0, 1, 1), lease_generation=1, text="again")
            )
            assert r.ok
        finally:
            await engine.shutdown()

    run(main())


def test_hundred_sessions_and_a_stuck_one_blocks_nobody() -> None:
    async def main() -> None:
        engine = await start_engine(stages(hang_on="stuck", chunk_ms=50.0))
        try:
            stuck, _, _ = await text_turn(engine, "I am stuck")
            sessions = await asyncio.gather(*(text_turn(engine, f"hi {i}") for i in range(100)))
            results = await asyncio.gather(
                *(
                    collect(engine, sid, lambda e: isinstance(e, ResponseDone), 20 * UNIT)
                    for sid, _, _ in sessions
                )
            )
            assert all(r[-1].status == "completed" for r in results)  # type: ignore[union-attr]
            # the stuck session still answers control calls, and closes cleanly
            f = Fence(stuck, 0, 1, 1)
            await engine.call(TouchCall(fence=f, lease_generation=1, activity="heartbeat"))
            await engine.call(CloseCall(fence=f, lease_generation=1))
            evs = await collect(engine, stuck, lambda e: isinstance(e, SessionLifecycle))
            assert isinstance(evs[-1], SessionLifecycle) and evs[-1].state == "closed"
            assert any(isinstance(e, ResponseDone) and e.status == "cancelled" for e in evs)
        finally:
            await engine.shutdown()

    run(main())


class HangingAbort(TestStage):
    """A backend whose abort never returns for sessions named in ``hang_for``."""

    hang_for: set[str]

    async def abort(self, request_ids: Sequence[str]) -> None:
        if any(r.split("/")[0] in self.hang_for for r in request_ids):
            await asyncio.Event().wait()
        await super().abort(request_ids)


def test_stuck_cleanup_holds_only_its_own_slot() -> None:
    async def main() -> None:
        opts = TestStageOptions(hang_on="stuck")
        llm = HangingAbort(opts, "llm")
        llm.hang_for = set()
        backends = {"asr": [TestStage(opts, "asr")], "llm": [llm], "tts": [TestStage(opts, "tts")]}
        engine = await start_engine(
            backends, max_sessions=2, cleanup_timeout_s=0.2, reaper_interval_s=0.05
        )
        try:
            sid, fence, gen = await text_turn(engine, "stuck forever")
            llm.hang_for.add(sid)
            await asyncio.sleep(0.05)
            await engine.call(CloseCall(fence=fence, lease_generation=gen))
            other, f2, _ = await text_turn(engine, "fine")
            with pytest.raises(ControlError) as info:
                await engine.call(OpenCall())
            assert info.value.code == "resource_exhausted"  # stuck one still holds its slot
            await engine.call(CloseCall(fence=f2, lease_generation=1))
            evs = await collect(
                engine, other, lambda e: isinstance(e, SessionLifecycle) and e.state == "closed"
            )
            assert evs[-1].state == "closed"  # type: ignore[union-attr]
            await engine.call(OpenCall())  # the other's slot was freed
            llm.hang_for.clear()  # the reaper's retry now succeeds
            evs = await collect(
                engine, sid, lambda e: isinstance(e, SessionLifecycle) and e.state == "closed"
            )
            assert engine.stats().sessions["closing"] == 0
        finally:
            await engine.shutdown()

    run(main())


def test_lease_expiry_publishes_and_frees_the_slot() -> None:
    async def main() -> None:
        engine = await start_engine(
            idle_ttl_s=0.3, reaper_interval_s=0.05, max_sessions=1, expiring_warning_s=0.2
        )
        try:
            res = await engine.call(OpenCall())
            assert res.session_id
            evs = await collect(
                engine,
                res.session_id,
                lambda e: isinstance(e, SessionLifecycle) and e.state == "closed",
            )
            states = [(e.state, e.reason) for e in evs if isinstance(e, SessionLifecycle)]
            assert states == [
                ("expiring", "idle_timeout"),
                ("expired", "idle_timeout"),
                ("closed", "idle_timeout"),
            ]
            await engine.call(OpenCall())
        finally:
            await engine.shutdown()

    run(main())


def test_detach_and_resume_keep_the_stream() -> None:
    async def main() -> None:
        engine = await start_engine(stages(**REALTIME), disconnect_grace_s=5.0)
        try:
            sid, fence, gen = await text_turn(engine)
            await engine.call(TouchCall(fence=fence, lease_generation=gen, activity="detach"))
            res = await engine.call(ResumeCall(session_id=sid, expected_lease_generation=gen))
            assert res.lease_generation == gen + 1
            with pytest.raises(ControlError, match="resumed elsewhere"):
                await engine.call(
                    TouchCall(fence=fence, lease_generation=gen, activity="heartbeat")
                )
            evs = await collect(engine, sid, lambda e: isinstance(e, ResponseDone))
            assert isinstance(evs[0], ResponseStarted) and evs[-1].status == "completed"  # type: ignore[union-attr]
        finally:
            await engine.shutdown()

    run(main())


def test_rpc_timeout_and_late_reply_are_dropped() -> None:
    async def main() -> None:
        engine = await start_engine()
        try:
            orch = engine.orchestrator
            assert orch is not None and orch.loop is not None
            busy = threading.Event()

            def block() -> None:
                busy.set()
                time.sleep(0.3)

            orch.loop.call_soon_threadsafe(block)
            assert busy.wait(5 * UNIT)  # the orchestrator is now stuck for 0.3 s
            with pytest.raises(ControlError) as info:
                await engine.call(OpenCall(), wait_s=0.05)
            assert info.value.code == "deadline_exceeded" and info.value.retryable
            waiters = engine.inbox.waiters
            for _ in range(100):
                if waiters.late_replies:
                    break
                await asyncio.sleep(0.01)
            assert waiters.late_replies == 1
            assert len(waiters) == 0
        finally:
            await engine.shutdown()

    run(main())


def test_fatal_engine_error_fails_everyone() -> None:
    async def main() -> None:
        engine = await start_engine(stages(hang_on="stuck"))
        try:
            sid, _, _ = await text_turn(engine, "stuck")
            orch = engine.orchestrator
            assert orch is not None

            def boom(msg: object) -> None:
                raise RuntimeError("injected orchestrator bug")

            orch._dispatch = boom  # type: ignore[method-assign]
            with pytest.raises(EngineDeadError):
                await engine.call(OpenCall())
            with pytest.raises(EngineDeadError):
                await engine.call(OpenCall())
            with pytest.raises(EngineDeadError):
                await collect(engine, sid, lambda e: False)
            assert not engine.ready
        finally:
            await engine.shutdown()

    run(main())


def test_batch_jobs() -> None:
    async def main() -> None:
        engine = await start_engine(stages(echo=True))
        try:
            items = [i async for i in engine.generate(SpeechJob(text="One two. Three four five."))]
            audio = [i for i in items if not isinstance(i, type(items[-1]))]
            assert audio and items[-1].audio_ms > 0  # type: ignore[union-attr]
            items = [
                i
                async for i in engine.generate(
                    ChatJob(messages=(ChatMessage("user", "repeat me"),), audio=True)
                )
            ]
            text = "".join(i.text for i in items if isinstance(i, TextOut))
            assert text == "repeat me"
            assert any(type(i).__name__ == "AudioOut" for i in items)
            items = [i async for i in engine.generate(TranscribeJob(audio=b"\0\0" * 16000))]
            assert isinstance(items[0], TranscriptOut) and items[0].text
        finally:
            await engine.shutdown()

    run(main())


def test_batch_failure_is_typed() -> None:
    async def main() -> None:
        engine = await start_engine(stages(fail_on="bad"))
        try:
            with pytest.raises(StageError):
                async for _ in engine.generate(SpeechJob(text="bad input")):
                    pass
        finally:
            await engine.shutdown()

    run(main())


def test_speculative_asr_on_pause_is_used_by_the_commit() -> None:
    async def main() -> None:
        backends = stages(asr_delay_s=0.3)
        engine = await start_engine(backends)
        try:
            sid, f, gen = await open_session(engine)
            await engine.call(AppendCall(fence=f, lease_generation=gen, audio=b"\1\0" * 8000))
            await engine.call(SignalCall(fence=f, lease_generation=gen, event="input.pause"))
            await asyncio.sleep(0.35)  # the silence window: the transcript is ready by now
            # trailing silence
            await engine.call(AppendCall(fence=f, lease_generation=gen, audio=b"\0\0" * 4000))
            await engine.call(CommitCall(fence=f, lease_generation=gen))
            evs = await collect(engine, sid, lambda e: isinstance(e, ResponseStarted))
            assert isinstance(evs[0], UserTranscript)
            asr = backends["asr"][0]
            assert isinstance(asr, TestStage)
            assert len(asr.submitted) == 1  # the pause's transcription served the commit
            assert asr.submitted[0].startswith(f"{sid}/asr/t0/")  # no epoch: survives cancels
            # a guess yields the ASR stage to committed turns (a loaded stage runs them first)
            assert asr.priorities[asr.submitted[0]] == Priority.SPECULATIVE
            # the user resumed: the speculation is dropped and the commit transcribes afresh
            await collect(engine, sid, lambda e: isinstance(e, ResponseDone))
            f2 = Fence(sid, 0, 1, 1)
            await engine.call(AppendCall(fence=f2, lease_generation=gen, audio=b"\1\0" * 100))
            await engine.call(SignalCall(fence=f2, lease_generation=gen, event="input.pause"))
            await engine.call(SignalCall(fence=f2, lease_generation=gen, event="input.resume"))
            await engine.call(AppendCall(fence=f2, lease_generation=gen, audio=b"\1\0" * 100))
            await engine.call(CommitCall(fence=f2, lease_generation=gen))
            await collect(engine, sid, lambda e: isinstance(e, ResponseDone))
            assert len(asr.submitted) == 3  # the dropped guess, then the commit's own ASR
            assert asr.priorities[asr.submitted[2]] == Priority.REALTIME
            orch = engine.orchestrator
            assert orch is not None and orch.speculation is not None
            assert orch.speculation.started == 2 and orch.speculation.used == 1
        finally:
            await engine.shutdown()

    run(main())


def test_speculation_is_used_when_sound_the_vad_did_not_call_speech_follows_the_pause() -> None:
    """Sound after the pause that the VAD did not call speech (no ``input.resume``: a breath,
    room noise, here 20 dB under the speech and still sounding at the commit) does not make
    the commit transcribe again: the pause's guess serves it. (It used to be judged by its
    energy, so in a recorded room a guess was almost never used, and ASR ran after the
    commit on the critical path.)"""

    async def main() -> None:
        backends = stages(asr_delay_s=0.05)
        engine = await start_engine(backends)
        try:
            sid, f, gen = await open_session(engine)
            await engine.call(AppendCall(fence=f, lease_generation=gen, audio=LOUD))
            await engine.call(SignalCall(fence=f, lease_generation=gen, event="input.pause"))
            await asyncio.sleep(0.2)
            # still sounding at the commit
            await engine.call(AppendCall(fence=f, lease_generation=gen, audio=SOFT))
            await engine.call(CommitCall(fence=f, lease_generation=gen))
            await collect(engine, sid, lambda e: isinstance(e, ResponseDone))
            asr = backends["asr"][0]
            assert isinstance(asr, TestStage)
            assert len(asr.submitted) == 1  # the guess served the commit
            orch = engine.orchestrator
            assert orch is not None and orch.speculation is not None
            assert orch.speculation.started == 1 and orch.speculation.used == 1
            assert orch.speculation.reguesses == 0
        finally:
            await engine.shutdown()

    run(main())


def test_sound_after_the_pause_is_guessed_again_once_it_ends() -> None:
    """A soft last syllable after the pause's guess, then quiet: the guess is made again
    for the whole audio as soon as ~100 ms of quiet follow the sound (not only at the
    commit, 500 ms into the silence), while the first guess's draft answer goes on; the
    commit then uses the new guess (and adopts the draft: the test ASR hears the same)."""

    async def main() -> None:
        backends = stages(asr_delay_s=0.05)
        engine = await start_engine(backends)
        try:
            sid, f, gen = await open_session(engine)
            await engine.call(AppendCall(fence=f, lease_generation=gen, audio=LOUD))
            await engine.call(SignalCall(fence=f, lease_generation=gen, event="input.pause"))
            await asyncio.sleep(0.2)
            orch = engine.orchestrator
            assert orch is not None and orch.speculation is not None
            assert orch.drafts is not None
            spec = orch.speculation

            async def settled() -> None:  # the engine applies an append after answering it
                await asyncio.sleep(0.1)

            first_draft = orch.drafts.drafts.get(sid)
            assert first_draft is not None  # the pause's guess is answered ahead
            # sounding: no new guess yet
            await engine.call(AppendCall(fence=f, lease_generation=gen, audio=SOFT))
            await settled()
            assert spec.started == 1
            quiet = b"\0\0" * 1280  # 80 ms: not yet enough quiet
            await engine.call(AppendCall(fence=f, lease_generation=gen, audio=quiet))
            await settled()
            assert spec.started == 1
            # 160 ms of quiet after the sound
            await engine.call(AppendCall(fence=f, lease_generation=gen, audio=quiet))
            await settled()
            assert spec.started == 2 and spec.reguesses == 1
            # the first guess's draft answer goes on (the words are most often the same)
            assert orch.drafts.drafts.get(sid) is first_draft
            # more quiet: the new guess covers it
            await engine.call(AppendCall(fence=f, lease_generation=gen, audio=quiet))
            await settled()
            assert spec.started == 2
            await engine.call(CommitCall(fence=f, lease_generation=gen))
            await collect(engine, sid, lambda e: isinstance(e, ResponseDone))
            asr = backends["asr"][0]
            assert isinstance(asr, TestStage)
            audios = [len(r.audio) for r in asr.requests if isinstance(r, AsrRequest)]
            assert audios == [len(LOUD), len(LOUD) + len(SOFT) + 2 * len(quiet)]
            assert spec.used == 1  # the commit took the second guess
        finally:
            await engine.shutdown()

    run(main())


def test_a_turn_carries_the_previous_turn_as_context_with_the_gap_between() -> None:
    """Context decoding (engine/orchestration/speculation.py): each turn's ASR request carries the
    session's previous turn (audio and transcript) and the silence between the two by the
    engine's clock, so the ASR can decode phrases of one stretch of speech together and a
    new utterance after a long gap alone. Once the assistant's answer to a turn has
    completed, the next turn is a new utterance: it carries no context, however soon it
    comes."""

    async def main() -> None:
        backends = stages(transcript="some words")
        engine = await start_engine(backends)
        try:
            sid, f, gen = await open_session(engine)
            half_s = b"\1\0" * 8000  # 0.5 s at 16 kHz, sent at once
            # turns 1-3 unanswered (0, 0 and 2 s apart), turn 4 answered, turn 5 right after
            for pause_s, respond in ((0.0, False), (0.0, False), (2.0, False), (0.0, True),
                                     (0.0, False)):  # fmt: skip
                await asyncio.sleep(pause_s)
                await engine.call(AppendCall(fence=f, lease_generation=gen, audio=half_s))
                f = (
                    await engine.call(CommitCall(fence=f, lease_generation=gen, respond=respond))
                ).accepted_fence or f
                if respond:
                    done = await collect(engine, sid, lambda e: isinstance(e, ResponseDone))
                    assert isinstance(done[-1], ResponseDone)
                    assert done[-1].status == "completed"
            asr = backends["asr"][0]
            assert isinstance(asr, TestStage)
            deadline = time.monotonic() + 10 * UNIT
            while len([r for r in asr.requests if isinstance(r, AsrRequest)]) < 5:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            reqs = [r for r in asr.requests if isinstance(r, AsrRequest)]
            assert reqs[0].context_audio == b"" and reqs[0].context_text == ""
            assert reqs[1].context_audio == half_s and reqs[1].context_text == "some words"
            assert reqs[1].context_gap_s < 0.5  # right after the previous turn
            assert reqs[2].context_audio == half_s
            assert reqs[2].context_gap_s >= 1.3  # 2 s later, less the turn's 0.5 s
            assert reqs[3].context_audio == half_s  # turn 3 was not answered
            # turn 4's answer completed before turn 5: no context, though right after
            assert reqs[4].context_audio == b"" and reqs[4].context_text == ""
        finally:
            await engine.shutdown()

    run(main())


def test_the_context_waits_for_a_slow_previous_turn_and_times_the_gap_in_audio() -> None:
    """The context of a turn must not depend on timing (the live transcript of a recording
    did, on a slow machine): when the previous turn's ASR is still running the next turn
    waits for its words instead of going without them, and the silence between two turns
    is read on the session's input clock (``stream_ms``) when the front end gives it, so a
    microphone stream that stalls (a busy client, a slow network) does not stretch it."""

    async def main() -> None:
        backends = stages(transcript="some words", asr_delay_s=0.4 * UNIT)
        engine = await start_engine(backends)
        try:
            _sid, f, gen = await open_session(engine)
            # three different loud tones of 0.5 s at 16 kHz
            tones = [np.sin(np.arange(8000) / (5 + i)) * 20000 for i in range(3)]
            audios = [t.astype("<i2").tobytes() for t in tones]
            # the turns start at 0.0, 0.8 and 3.0 s of input (0.3 and 1.7 s of silence
            # between them), but turn 2 arrives before turn 1's ASR is done and turn 3
            # right after turn 2's commit on the wall clock
            for i, at_ms in enumerate((0.0, 800.0, 3000.0)):
                await engine.call(
                    AppendCall(fence=f, lease_generation=gen, audio=audios[i], stream_ms=at_ms)
                )
                if i:  # a pause guess transcribes the turn before its commit
                    await engine.call(
                        SignalCall(
                            fence=f, lease_generation=gen, event="input.pause", respond=False
                        )
                    )
                f = (
                    await engine.call(CommitCall(fence=f, lease_generation=gen, respond=False))
                ).accepted_fence or f
            asr = backends["asr"][0]
            assert isinstance(asr, TestStage)
            deadline = time.monotonic() + 10 * UNIT
            while len([r for r in asr.requests if isinstance(r, AsrRequest)]) < 3:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            reqs = [r for r in asr.requests if isinstance(r, AsrRequest)]
            assert reqs[0].context_audio == b"" and reqs[0].context_text == ""
            # turn 2's guess began while turn 1 was in the ASR: it waited for its words
            assert reqs[1].context_audio == audios[0] and reqs[1].context_text == "some words"
            assert reqs[1].context_gap_s == pytest.approx(0.3)
            # 1.7 s of silence by the input clock, though turn 3 followed at once
            assert reqs[2].context_audio == audios[1] and reqs[2].context_text == "some words"
            assert reqs[2].context_gap_s == pytest.approx(1.7)
        finally:
            await engine.shutdown()

    run(main())


def test_barge_in_keeps_committed_words_that_were_not_heard_yet() -> None:
    async def main() -> None:
        backends = stages(asr_delay_s=0.3, transcript="first half of a question")
        engine = await start_engine(backends)
        try:
            sid, f, gen = await open_session(engine)
            await engine.call(AppendCall(fence=f, lease_generation=gen, audio=b"\1\0" * 1600))
            # still in ASR when ...
            f1 = (await engine.call(CommitCall(fence=f, lease_generation=gen))).accepted_fence
            assert f1
            nxt = Fence(sid, 1, f1.turn_id, f1.response_seq)
            # ... the user goes on
            await engine.call(
                SignalCall(fence=f1, lease_generation=gen, event="barge_in", next_fence=nxt)
            )
            await engine.call(
                AppendCall(fence=nxt, lease_generation=gen, text="and the second half")
            )
            await engine.call(CommitCall(fence=nxt, lease_generation=gen))
            evs = await collect(engine, sid, lambda e: isinstance(e, ResponseDone), 10 * UNIT)
            heard = [e for e in evs if isinstance(e, UserTranscript)]
            assert [h.text for h in heard] == ["first half of a question"]
            assert heard[0].fence.epoch == 1 and heard[0].fence.turn_id == 1
            done = evs[-1]
            assert isinstance(done, ResponseDone) and done.status == "completed"
            asr = backends["asr"][0]
            assert isinstance(asr, TestStage)
            assert len(asr.submitted) == 1  # the cancelled job's ASR was picked up, not redone
            history = engine.orchestrator.control.sessions[sid].history  # type: ignore[union-attr]
            user = [m.content for m in history.messages("sys") if m.role == "user"]
            assert "first half of a question" in user[-1] and "second half" in user[-1]
        finally:
            await engine.shutdown()

    run(main())


def test_start_cancelled_while_loading_leaves_nothing_behind() -> None:
    async def main() -> None:
        task = asyncio.create_task(start_engine(stages(load_delay_s=0.3)))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(main())


def test_batch_work_waits_while_a_session_waits_for_its_first_audio() -> None:
    async def main() -> None:
        engine = await start_engine(stages(asr_delay_s=0.3))
        try:
            sid, f, gen = await open_session(engine)
            await engine.call(AppendCall(fence=f, lease_generation=gen, audio=b"\1\0" * 1600))
            # the turn is now in its ASR (0.3 s)
            await engine.call(CommitCall(fence=f, lease_generation=gen))
            await asyncio.sleep(0.05)
            order: list[str] = []

            async def batch() -> None:
                async for item in engine.generate(SpeechJob(text="batch words here")):
                    if type(item).__name__ == "AudioOut" and "batch" not in order:
                        order.append("batch")

            async def session() -> None:
                async for ev in engine.session_events(sid):
                    if isinstance(ev, AudioChunk) and "session" not in order:
                        order.append("session")
                    if isinstance(ev, ResponseDone):
                        return

            await asyncio.wait_for(asyncio.gather(batch(), session()), 10 * UNIT)
            assert order == ["session", "batch"]
            orch = engine.orchestrator
            assert orch is not None and orch.admission.waits >= 1
            assert orch.admission.critical == 0
        finally:
            await engine.shutdown()

    run(main())


def test_a_new_pause_never_discards_the_transcription_a_turn_waits_for() -> None:
    async def main() -> None:
        engine = await start_engine(stages(asr_delay_s=0.3))
        try:
            sid, f, gen = await open_session(engine)
            await engine.call(AppendCall(fence=f, lease_generation=gen, audio=b"\1\0" * 1600))
            await engine.call(SignalCall(fence=f, lease_generation=gen, event="input.pause"))
            # claims the pause's ASR
            f1 = (await engine.call(CommitCall(fence=f, lease_generation=gen))).accepted_fence
            assert f1
            await asyncio.sleep(0.05)
            # the next utterance ...
            await engine.call(AppendCall(fence=f1, lease_generation=gen, audio=b"\2\0" * 1600))
            # ... pauses while turn 1 waits
            await engine.call(SignalCall(fence=f1, lease_generation=gen, event="input.pause"))
            evs = await collect(engine, sid, lambda e: isinstance(e, ResponseDone), 5 * UNIT)
            done = evs[-1]
            assert isinstance(done, ResponseDone) and done.status == "completed"
            assert done.fence == f1
        finally:
            await engine.shutdown()

    run(main())
