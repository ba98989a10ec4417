"""Speculative responses (engine/orchestration/drafts.py) on the deterministic test stage, both
transports.

A pause's transcript is answered ahead of the commit and the output held: a commit releases
exactly the held audio, in order, once, under the turn's own fence; speech that resumes (or
anything that changes what the answer would be) drops it, and none of its bytes is sent.
"""

from __future__ import annotations

import asyncio
import gc
import weakref

import msgspec
import pytest

from duplex_contract.control import AppendCall, CommitCall, OpenCall, SignalCall
from duplex_contract.errors import StageError
from duplex_contract.fence import Fence
from duplex_contract.session_events import AudioChunk, ResponseDone, SessionEvent, UserTranscript
from duplex_contract.settings import SessionUpdate
from engine.api.client import AsyncEngine
from engine.orchestration.drafts import Draft
from engine.orchestration.orchestrator import Orchestrator
from engine.stages.testing import TestStage, TestStageOptions
from tests.engine.conftest import UNIT, collect, make_config, open_engine, run, stages

pytestmark = pytest.mark.usefixtures("transport")  # both engine transports

SPEECH = b"\1\0" * 8000  # 0.5 s at 16 kHz
SILENCE = b"\0\0" * 4000


def _orch(engine: AsyncEngine) -> Orchestrator:
    orch = engine.orchestrator  # the loopback engine exposes its server's too (conftest)
    assert isinstance(orch, Orchestrator)
    return orch


def _drafts(orch: Orchestrator) -> dict[str, Draft]:
    """Each session's draft (the orchestrator's draft book)."""
    assert orch.drafts is not None
    return orch.drafts.drafts


async def _start(speculative: bool = True) -> tuple[AsyncEngine, dict[str, list[TestStage]]]:
    backends = stages(asr_delay_s=0.05)
    cfg = msgspec.structs.replace(make_config(), speculative_response=speculative)
    engine = await open_engine(cfg, backends)
    return engine, backends  # type: ignore[return-value]


async def _finished(orch: Orchestrator, sid: str) -> Draft:
    """Wait until the session's draft has finished (produced all its audio, or failed)."""
    for _ in range(200):
        draft = _drafts(orch).get(sid)
        if draft is not None and draft.task is not None and draft.task.done():
            return draft
        await asyncio.sleep(0.02)
    raise AssertionError("the draft did not finish")


async def _held(orch: Orchestrator, sid: str) -> int:
    """Wait until the session's draft has produced all its audio; return the bytes held."""
    return (await _finished(orch, sid)).held_bytes


async def _speak_and_pause(engine: AsyncEngine) -> tuple[str, Fence, int, Orchestrator]:
    """A session that spoke, then paused (its draft starts)."""
    res = await engine.call(OpenCall())
    sid, f, gen = res.session_id, res.accepted_fence, res.lease_generation
    assert sid and f
    await engine.call(AppendCall(fence=f, lease_generation=gen, audio=SPEECH))
    await engine.call(SignalCall(fence=f, lease_generation=gen, event="input.pause"))
    return sid, f, gen, _orch(engine)


async def _paused(engine: AsyncEngine) -> tuple[str, Fence, int, Orchestrator]:
    """A session that spoke, then paused: its draft has produced (and holds) its audio."""
    sid, f, gen, orch = await _speak_and_pause(engine)
    assert await _held(orch, sid) > 0
    return sid, f, gen, orch


async def _no_events(engine: AsyncEngine, sid: str) -> list[SessionEvent]:
    """Events delivered within a short wait (there must be none while a draft is held)."""
    try:
        return await collect(engine, sid, lambda e: True, within=0.3 * UNIT)
    except TimeoutError:
        return []


async def _spoken_turn(speculative: bool) -> tuple[list[SessionEvent], AsyncEngine, dict]:  # type: ignore[type-arg]
    engine, backends = await _start(speculative)
    sid, f, gen, orch = await _speak_and_pause(engine)
    if speculative:
        assert await _held(orch, sid) > 0
        assert await _no_events(engine, sid) == []  # held, not sent
    await engine.call(AppendCall(fence=f, lease_generation=gen, audio=SILENCE))
    await engine.call(CommitCall(fence=f, lease_generation=gen))
    evs = await collect(engine, sid, lambda e: isinstance(e, ResponseDone), 10 * UNIT)
    return evs, engine, backends


def test_a_committed_turn_releases_exactly_the_held_audio_once() -> None:
    async def main() -> None:
        plain, engine0, _ = await _spoken_turn(speculative=False)
        await engine0.shutdown()
        evs, engine, backends = await _spoken_turn(speculative=True)
        try:
            done = evs[-1]
            assert isinstance(done, ResponseDone) and done.status == "completed"
            assert "speculative_ms" in (done.timing_ms or {})  # the draft answered it
            timing = done.timing_ms or {}  # and where its time went, each part measured
            assert all(timing[k] >= 0 for k in ("draft_asr", "draft_llm", "draft_tts"))
            chunks = [e for e in evs if isinstance(e, AudioChunk)]
            expected = [e for e in plain if isinstance(e, AudioChunk)]
            assert chunks and [c.pcm for c in chunks] == [c.pcm for c in expected]
            assert [c.audio_start_ms for c in chunks] == [c.audio_start_ms for c in expected]
            assert all(c.fence == done.fence for c in chunks)  # the turn's fence, not a draft's
            assert len(backends["llm"][0].submitted) == 1  # the draft's request, not a second
            assert "/draft" in backends["llm"][0].submitted[0]
            assert _orch(engine).counters.drafts == {"started": 1, "used": 1, "dropped": 0}
            assert await _no_events(engine, done.fence.session_id) == []  # once: no repeats
        finally:
            await engine.shutdown()

    run(main())


def test_speech_that_resumes_drops_the_draft_and_sends_none_of_it() -> None:
    async def main() -> None:
        engine, backends = await _start()
        try:
            sid, f, gen, orch = await _paused(engine)
            draft = _drafts(orch)[sid]
            assert orch.reaper.session_bytes()["draft"] == draft.held_bytes  # accounted (metrics)
            # the user goes on
            await engine.call(SignalCall(fence=f, lease_generation=gen, event="input.resume"))
            assert sid not in _drafts(orch) and draft.held_bytes == 0
            assert orch.reaper.session_bytes()["draft"] == 0
            await engine.call(AppendCall(fence=f, lease_generation=gen, audio=SPEECH + SILENCE))
            await engine.call(CommitCall(fence=f, lease_generation=gen))
            evs = await collect(engine, sid, lambda e: isinstance(e, ResponseDone), 10 * UNIT)
            done = evs[-1]
            assert isinstance(done, ResponseDone) and done.status == "completed"
            assert "speculative_ms" not in (done.timing_ms or {})
            chunks = [e for e in evs if isinstance(e, AudioChunk)]
            assert chunks and all(c.fence == done.fence for c in chunks)
            # the audio sent is one whole answer (from 0 ms, no gap, nothing twice)
            starts = [c.audio_start_ms for c in chunks]
            assert starts[0] == 0 and starts == sorted(set(starts))
            llm = backends["llm"][0].submitted
            assert len(llm) == 2 and "/draft" in llm[0] and "/draft" not in llm[1]
            assert orch.counters.drafts == {"started": 1, "used": 0, "dropped": 1}
        finally:
            await engine.shutdown()

    run(main())


def test_a_changed_prompt_is_not_answered_by_the_draft() -> None:
    """New instructions between the pause and the commit: the draft answered another
    prompt, so the turn drops it and starts its own response."""

    async def main() -> None:
        engine, backends = await _start()
        try:
            sid, f, gen, orch = await _paused(engine)
            await engine.call(
                SignalCall(
                    fence=f,
                    lease_generation=gen,
                    event="session.update",
                    update=SessionUpdate(instructions="Be terse."),
                )
            )
            await engine.call(AppendCall(fence=f, lease_generation=gen, audio=SILENCE))
            await engine.call(CommitCall(fence=f, lease_generation=gen))
            evs = await collect(engine, sid, lambda e: isinstance(e, ResponseDone), 10 * UNIT)
            done = evs[-1]
            assert isinstance(done, ResponseDone) and done.status == "completed"
            assert "speculative_ms" not in (done.timing_ms or {})
            assert len(backends["llm"][0].submitted) == 2
            assert orch.counters.drafts["used"] == 0 and orch.counters.drafts["dropped"] == 1
        finally:
            await engine.shutdown()

    run(main())


def test_another_sessions_real_turn_drops_the_draft() -> None:
    async def main() -> None:
        engine, _ = await _start()
        try:
            a = await engine.call(OpenCall())
            b = await engine.call(OpenCall())
            assert a.session_id and a.accepted_fence and b.session_id and b.accepted_fence
            await engine.call(AppendCall(fence=a.accepted_fence, lease_generation=1, audio=SPEECH))
            await engine.call(
                SignalCall(fence=a.accepted_fence, lease_generation=1, event="input.pause")
            )
            orch = _orch(engine)
            await asyncio.sleep(0.01)
            assert a.session_id in _drafts(orch)
            await engine.call(AppendCall(fence=b.accepted_fence, lease_generation=1, text="hello"))
            await engine.call(CommitCall(fence=b.accepted_fence, lease_generation=1))
            await collect(engine, b.session_id, lambda e: isinstance(e, ResponseDone), 10 * UNIT)
            assert a.session_id not in _drafts(orch)  # dropped when b's turn started
            assert orch.counters.drafts["dropped"] == 1
            # a's turn still gets its answer, started at its commit
            await engine.call(AppendCall(fence=a.accepted_fence, lease_generation=1, audio=SILENCE))
            await engine.call(CommitCall(fence=a.accepted_fence, lease_generation=1))
            evs = await collect(
                engine, a.session_id, lambda e: isinstance(e, ResponseDone), 10 * UNIT
            )
            done = evs[-1]
            assert isinstance(done, ResponseDone) and done.status == "completed"
            assert any(isinstance(e, AudioChunk) for e in evs)
        finally:
            await engine.shutdown()

    run(main())


def test_a_barge_in_drops_the_draft() -> None:
    async def main() -> None:
        engine, _ = await _start()
        try:
            sid, f, gen, orch = await _paused(engine)
            nxt = Fence(sid, f.epoch + 1, f.turn_id, f.response_seq)
            await engine.call(
                SignalCall(fence=f, lease_generation=gen, event="barge_in", next_fence=nxt)
            )
            assert sid not in _drafts(orch) and orch.counters.drafts["dropped"] == 1
            assert [e for e in await _no_events(engine, sid) if isinstance(e, AudioChunk)] == []
        finally:
            await engine.shutdown()

    run(main())


def test_no_draft_when_the_commit_will_not_ask_for_a_response() -> None:
    """A pause signalled with ``respond=False`` (create_response off, a transcription
    session) is transcribed ahead but never answered ahead."""

    async def main() -> None:
        engine, backends = await _start()
        try:
            res = await engine.call(OpenCall())
            sid, f, gen = res.session_id, res.accepted_fence, res.lease_generation
            assert sid and f
            await engine.call(AppendCall(fence=f, lease_generation=gen, audio=SPEECH))
            await engine.call(
                SignalCall(fence=f, lease_generation=gen, event="input.pause", respond=False)
            )
            orch = _orch(engine)
            await asyncio.sleep(0.2)
            assert sid not in _drafts(orch) and orch.counters.drafts["started"] == 0
            assert backends["llm"][0].submitted == [] and len(backends["asr"][0].submitted) == 1
        finally:
            await engine.shutdown()

    run(main())


def test_a_pause_while_another_sessions_turn_runs_is_not_guessed() -> None:
    """The stages share the machine's cores: while a real turn runs in another session, a
    pause gets no speculative transcript and no draft (the commit transcribes it); once no
    other turn runs, pauses are guessed again."""

    async def main() -> None:
        backends = stages(asr_delay_s=0.05, token_interval_s=0.05 * UNIT)
        engine = await open_engine(make_config(), backends)
        try:
            a = await engine.call(OpenCall())
            b = await engine.call(OpenCall())
            assert a.session_id and a.accepted_fence and b.session_id and b.accepted_fence
            orch = _orch(engine)
            await engine.call(AppendCall(fence=b.accepted_fence, lease_generation=1, text="hello"))
            # b's turn: slow LLM, still running
            await engine.call(CommitCall(fence=b.accepted_fence, lease_generation=1))
            for _ in range(100):
                if orch.runners.turn_running(besides=a.session_id):
                    break
                await asyncio.sleep(0.01)
            asr_before = len(backends["asr"][0].submitted)
            await engine.call(AppendCall(fence=a.accepted_fence, lease_generation=1, audio=SPEECH))
            await engine.call(
                SignalCall(fence=a.accepted_fence, lease_generation=1, event="input.pause")
            )
            await asyncio.sleep(0.1)
            assert orch.speculation is not None
            assert (orch.speculation.started, orch.speculation.skipped) == (0, 1)
            assert a.session_id not in _drafts(orch) and orch.counters.drafts["started"] == 0
            assert len(backends["asr"][0].submitted) == asr_before  # no ASR for the guess
            assert engine.stats().speculative_transcripts["skipped"] == 1
            await collect(engine, b.session_id, lambda e: isinstance(e, ResponseDone), 20 * UNIT)
            # a's commit transcribes its turn and answers it
            await engine.call(AppendCall(fence=a.accepted_fence, lease_generation=1, audio=SILENCE))
            done = await engine.call(CommitCall(fence=a.accepted_fence, lease_generation=1))
            evs = await collect(
                engine, a.session_id, lambda e: isinstance(e, ResponseDone), 20 * UNIT
            )
            assert isinstance(evs[-1], ResponseDone) and evs[-1].status == "completed"
            assert done.accepted_fence is not None
            # nothing else runs now: the next pause is guessed (and answered ahead)
            for _ in range(100):
                if not orch.runners.turn_running(besides=""):
                    break
                await asyncio.sleep(0.01)
            await engine.call(
                AppendCall(fence=done.accepted_fence, lease_generation=1, audio=SPEECH)
            )
            await engine.call(
                SignalCall(fence=done.accepted_fence, lease_generation=1, event="input.pause")
            )
            await asyncio.sleep(0.05)
            assert orch.speculation.started == 1
            assert a.session_id in _drafts(orch)
        finally:
            await engine.shutdown()

    run(main())


@pytest.mark.parametrize("then", ["dropped", "adopted"])
def test_a_draft_whose_stage_fails_is_freed_without_the_cyclic_gc(then: str) -> None:
    """A draft's LLM request fails. Dropped (speech resumes) or adopted by the commit (the
    turn fails with it), the draft is freed as soon as it is let go: its task's error keeps
    the draft's frame, and the draft must not keep the task (or it waits in a cycle, with
    what it held, for the cyclic GC)."""

    async def main() -> None:
        backends = stages(asr_delay_s=0.05)
        opts = TestStageOptions(transcript="what is the weather like today", fail_on="weather")
        backends["llm"] = [TestStage(opts, "llm")]
        engine = await open_engine(make_config(), backends)
        gc.disable()
        try:
            sid, f, gen, orch = await _speak_and_pause(engine)
            draft = await _finished(orch, sid)
            assert draft.task is not None and isinstance(draft.task.exception(), StageError)
            freed = weakref.ref(draft)
            del draft
            if then == "dropped":
                await engine.call(SignalCall(fence=f, lease_generation=gen, event="input.resume"))
                assert orch.counters.drafts["dropped"] == 1
            else:
                await engine.call(AppendCall(fence=f, lease_generation=gen, audio=SILENCE))
                await engine.call(CommitCall(fence=f, lease_generation=gen))
                evs = await collect(engine, sid, lambda e: isinstance(e, ResponseDone), 10 * UNIT)
                done = evs[-1]
                assert isinstance(done, ResponseDone) and done.status == "failed"
                assert orch.counters.drafts["used"] == 1
            for _ in range(50):
                if freed() is None:
                    break
                await asyncio.sleep(0.02)
            assert freed() is None, "the failed draft is left to the cyclic GC"
        finally:
            gc.enable()
            await engine.shutdown()

    run(main())


def test_a_pause_that_asks_for_words_gets_its_guess_s_transcript_once() -> None:
    """``input.pause`` with ``words=N`` (the front end's end_of_turn: words): the guess's
    transcript comes back as a non-final UserTranscript tagged N, the same words the commit
    then reports; a pause without ``words``, or one that speech ended, sends none."""

    def guesses(evs: list[SessionEvent]) -> list[UserTranscript]:
        return [e for e in evs if isinstance(e, UserTranscript) and e.guess is not None]

    async def main() -> None:
        engine, _ = await _start()
        try:
            res = await engine.call(OpenCall())
            sid, f, gen = res.session_id, res.accepted_fence, res.lease_generation
            assert sid and f
            await engine.call(AppendCall(fence=f, lease_generation=gen, audio=SPEECH))
            await engine.call(SignalCall(fence=f, lease_generation=gen, event="input.pause"))
            assert guesses(await _no_events(engine, sid)) == []  # not asked
            await engine.call(SignalCall(fence=f, lease_generation=gen, event="input.resume"))
            await engine.call(AppendCall(fence=f, lease_generation=gen, audio=SPEECH))
            await engine.call(
                SignalCall(fence=f, lease_generation=gen, event="input.pause", words=7)
            )
            evs = await collect(engine, sid, lambda e: bool(guesses([e])), 5 * UNIT)
            (words,) = guesses(evs)
            assert words.guess == 7 and not words.final and words.text.strip()
            assert words.fence.session_id == sid
            assert guesses(await _no_events(engine, sid)) == []  # once
            # the user goes on at once: that guess is dropped, its words never sent
            await engine.call(SignalCall(fence=f, lease_generation=gen, event="input.resume"))
            await engine.call(AppendCall(fence=f, lease_generation=gen, audio=SPEECH))
            await engine.call(
                SignalCall(fence=f, lease_generation=gen, event="input.pause", words=8)
            )
            await engine.call(SignalCall(fence=f, lease_generation=gen, event="input.resume"))
            assert guesses(await _no_events(engine, sid)) == []
            await engine.call(
                SignalCall(fence=f, lease_generation=gen, event="input.pause", words=9)
            )
            evs = await collect(engine, sid, lambda e: bool(guesses([e])), 5 * UNIT)
            (last,) = guesses(evs)
            assert last.guess == 9
            await engine.call(CommitCall(fence=f, lease_generation=gen))
            evs = await collect(engine, sid, lambda e: isinstance(e, ResponseDone), 10 * UNIT)
            final = [e for e in evs if isinstance(e, UserTranscript) and e.final]
            assert [t.text for t in final] == [last.text]  # the guess the commit used
            assert guesses(evs) == []
        finally:
            await engine.shutdown()

    run(main())
