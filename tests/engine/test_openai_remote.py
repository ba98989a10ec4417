"""Remote stages (backend ``openai``) against a real HTTP server that misbehaves on demand:
streaming, fenced request ids, aborts that close the stream, retries, the circuit breaker,
and each kind of bad answer failing one turn only."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from duplex_contract.control import AppendCall, CommitCall, OpenCall, SignalCall
from duplex_contract.fence import Fence
from duplex_contract.session_events import AudioChunk, ResponseDone, SessionEvent, TextDelta
from duplex_contract.settings import SessionSettings
from engine.api.client import AsyncEngine
from engine.config import engine_config
from tests.engine.conftest import UNIT, collect, open_engine, run
from tests.engine.fake_openai import Fake, fake_openai

pytestmark = pytest.mark.usefixtures("transport")


@pytest.fixture
def fake() -> Iterator[Fake]:
    with fake_openai() as f:
        yield f


def remote_config(fake: Fake, **llm: Any) -> Any:
    base = f"http://{fake.addr}/v1"
    return engine_config(
        {
            "stages": {
                "asr": {"backend": "openai", "options": {"base_url": base}},
                "llm": {
                    "backend": "openai",
                    "options": {"base_url": base, "model": "m", "breaker_failures": 50, **llm},
                },
                "tts": {"backend": "openai", "options": {"base_url": base, "chunk_ms": 50}},
            },
            "routes": {"voice": ["asr", "llm", "tts"], "text": ["asr", "llm"]},
            "vad": {"backend": "energy"},
        }
    )


async def turn(
    engine: AsyncEngine, modalities: tuple[str, ...] = ("text",), sid: str | None = None
) -> tuple[str, list[SessionEvent]]:
    if sid is None:
        res = await engine.call(OpenCall(config=SessionSettings(output_modalities=modalities)))  # type: ignore[arg-type]
        assert res.session_id and res.accepted_fence
        sid, fence = res.session_id, res.accepted_fence
    else:
        session = engine.orchestrator.control.sessions[sid]  # type: ignore[union-attr]
        fence = session.fence
    await engine.call(AppendCall(fence=fence, lease_generation=1, text="hi"))
    await engine.call(CommitCall(fence=fence, lease_generation=1))
    events = await collect(engine, sid, lambda e: isinstance(e, ResponseDone), 10 * UNIT)
    return sid, events


def done_of(events: list[SessionEvent]) -> ResponseDone:
    done = events[-1]
    assert isinstance(done, ResponseDone)
    return done


def test_a_remote_llm_streams_with_fenced_ids_and_extra_body(fake: Fake) -> None:
    async def main() -> None:
        engine = await open_engine(
            remote_config(fake, extra_body={"priority": 3}, request_id_field=True)
        )
        try:
            _, events = await turn(engine)
            text = "".join(e.text for e in events if isinstance(e, TextDelta))
            assert text == "".join(fake.words)
            done = done_of(events)
            assert done.status == "completed" and done.output_tokens == len(fake.words)
            req = next(r for r in fake.requests if r["path"] == "chat")
            assert req["id"] == f"{done.fence.key()}/llm" == req["request_id"]
            assert req["priority"] == 3 and req["stream"] is True and req["model"] == "m"
            assert req["messages"][-1] == {"role": "user", "content": "hi"}
        finally:
            await engine.shutdown()

    run(main())


def test_remote_asr_and_tts_make_a_voice_turn(fake: Fake) -> None:
    async def main() -> None:
        engine = await open_engine(remote_config(fake))
        try:
            res = await engine.call(OpenCall(config=SessionSettings(output_sample_rate=16000)))
            assert res.session_id and res.accepted_fence
            await engine.call(
                AppendCall(fence=res.accepted_fence, lease_generation=1, audio=bytes(2 * 16000))
            )
            await engine.call(CommitCall(fence=res.accepted_fence, lease_generation=1))
            events = await collect(engine, res.session_id, lambda e: isinstance(e, ResponseDone))
            assert done_of(events).status == "completed"
            chunks = [e for e in events if isinstance(e, AudioChunk)]
            assert chunks and all(c.sample_rate == 16000 for c in chunks)
            total_ms = sum(c.duration_ms for c in chunks)
            paths = [r["path"] for r in fake.requests]
            assert paths[0] == "asr" and paths[1] == "chat" and paths.count("tts") >= 1
            segments = paths.count("tts")  # 500 ms of 24 kHz audio each, resampled to 16 kHz
            assert abs(total_ms - 500 * segments) <= 20 * segments, (total_ms, segments)
        finally:
            await engine.shutdown()

    run(main())


@pytest.mark.parametrize(
    ("mode", "says"),
    [
        ("http500", "HTTP 500: boom"),
        ("notjson", "not JSON in the event stream"),
        ("truncated", "ended without [DONE] (truncated)"),
        ("stall", "no data for 1 s (read timeout)"),
    ],
)
def test_each_bad_answer_fails_its_turn_only(fake: Fake, mode: str, says: str) -> None:
    async def main() -> None:
        engine = await open_engine(remote_config(fake, read_timeout_s=1.0, retries=0))
        try:
            fake.mode = mode
            sid, events = await turn(engine)
            done = done_of(events)
            assert done.status == "failed" and done.error is not None
            assert says in done.error.message, done.error.message
            assert done.reason == "stage_failed"
            fake.mode = "ok"  # the session lives on: its next turn works
            _, events = await turn(engine, sid=sid)
            assert done_of(events).status == "completed"
        finally:
            await engine.shutdown()

    run(main())


def test_connect_errors_are_retried_then_the_breaker_opens_and_recovers(fake: Fake) -> None:
    async def main() -> None:
        engine = await open_engine(
            remote_config(fake, retries=2, backoff_s=0.05, breaker_failures=4, breaker_reset_s=1.0)
        )
        try:
            fake.fail_first = 2  # two 503s, then fine: retried with backoff, nothing lost
            sid, events = await turn(engine)
            assert done_of(events).status == "completed"
            assert sum(r["path"] == "chat" for r in fake.requests) == 3
            fake.mode = "http503"
            _, events = await turn(engine, sid=sid)  # 3 tries: 3 failures
            done = done_of(events)
            assert done.status == "failed" and done.reason == "stage_unavailable"
            _, events = await turn(engine, sid=sid)  # the 4th failure opens the circuit
            asked = len(fake.requests)
            _, events = await turn(engine, sid=sid)  # fails at once: nothing is sent
            done = done_of(events)
            assert done.reason == "stage_unavailable" and done.error is not None
            assert "circuit open" in done.error.message
            assert len(fake.requests) == asked
            await asyncio.sleep(0.3)  # the figures reach a socket front end
            down = engine.stats().stages_down
            assert "llm" in down and "HTTP 503" in down["llm"]
            fake.mode = "ok"
            await asyncio.sleep(1.0)  # reset: one probe goes through and closes it
            _, events = await turn(engine, sid=sid)
            assert done_of(events).status == "completed"
            await asyncio.sleep(0.3)
            assert engine.stats().stages_down == {}
        finally:
            await engine.shutdown()

    run(main())


def test_a_barge_in_closes_the_remote_stream_and_nothing_follows(fake: Fake) -> None:
    async def main() -> None:
        fake.mode = "slow"
        fake.words = [f" w{i}" for i in range(100)]
        engine = await open_engine(remote_config(fake))
        try:
            res = await engine.call(OpenCall(config=SessionSettings(output_modalities=("text",))))
            assert res.session_id and res.accepted_fence
            sid, fence = res.session_id, res.accepted_fence
            await engine.call(AppendCall(fence=fence, lease_generation=1, text="go"))
            commit = await engine.call(CommitCall(fence=fence, lease_generation=1))
            assert commit.accepted_fence is not None
            fence = commit.accepted_fence
            async for ev in engine.session_events(sid):
                if isinstance(ev, TextDelta):
                    break
            nxt = Fence(sid, fence.epoch + 1, fence.turn_id, fence.response_seq)
            await engine.call(
                SignalCall(fence=fence, lease_generation=1, event="barge_in", next_fence=nxt)
            )
            tail = await collect(engine, sid, lambda e: isinstance(e, ResponseDone))
            assert done_of(tail).status == "cancelled"
            assert not [e for e in tail if isinstance(e, TextDelta)]
            for _ in range(100):  # the server saw its client go away
                if fake.disconnected:
                    break
                await asyncio.sleep(0.02)
            assert fake.disconnected == 1
        finally:
            await engine.shutdown()

    run(main())
