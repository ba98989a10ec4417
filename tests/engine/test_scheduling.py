"""Scheduling policies (engine/orchestration/scheduling.py): ``serial`` keeps the CPU rules,
``capacity`` lets batch work, pause guesses and draft answers run beside real turns while the stages
they need have room, and makes them yield to a waiting real-time request."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

from duplex_contract.batch import AudioOut, SpeechJob
from duplex_contract.control import AppendCall, CommitCall, OpenCall, SignalCall
from duplex_contract.errors import ConfigError
from duplex_contract.session_events import AudioChunk, ResponseDone
from engine.api.client import AsyncEngine
from engine.config import SchedulingConfig, engine_config, load_engine_config
from engine.messages import AsrRequest, LlmRequest, Priority, TtsRequest
from engine.orchestration.capacity import CapacityScheduler
from engine.orchestration.drafts import Draft
from engine.orchestration.orchestrator import Orchestrator
from engine.orchestration.policies import make_scheduler
from engine.orchestration.scheduling import SerialScheduler, request_kind
from engine.pipeline.stage_slots import replica_capacity
from engine.stages.testing import TestStageOptions
from engine.stages.testing_batch import BatchTestStage
from tests.engine.conftest import ROOT, UNIT, collect, make_config, open_engine, run, stages

SPEECH = b"\1\0" * 8000  # 0.5 s at 16 kHz
SILENCE = b"\0\0" * 4000


def _cfg(**sched: Any) -> Any:
    return msgspec.structs.replace(make_config(), scheduling=SchedulingConfig(**sched))


def _orch(engine: AsyncEngine) -> Orchestrator:
    orch = engine.orchestrator
    assert isinstance(orch, Orchestrator)
    return orch


def _drafts(orch: Orchestrator) -> dict[str, Draft]:
    """Each session's draft (the orchestrator's draft book)."""
    assert orch.drafts is not None
    return orch.drafts.drafts


def _llm(rid: str, priority: Priority = Priority.REALTIME) -> LlmRequest:
    return LlmRequest(request_id=rid, messages=(), priority=priority)


# ----------------------------------------------------------------------------- config
def test_cpu_and_test_configs_keep_the_serial_rules() -> None:
    for name in ("cpu.yaml", "test.yaml"):
        assert load_engine_config(ROOT / "configs" / name).scheduling.policy == "serial"


@pytest.mark.parametrize(
    ("scheduling", "message"),
    [
        ({"policy": "greedy"}, "engine.scheduling.policy"),
        ({"reserv": 1}, "engine.scheduling"),
        ({"reserve": -1}, "engine.scheduling.reserve"),
        ({"batch_concurrency": 0}, "engine.scheduling.batch_concurrency"),
        ({"capacity": {"nope": 4}}, "engine.scheduling.capacity.nope: no such stage"),
    ],
)
def test_bad_scheduling_config_is_refused_naming_the_field(
    scheduling: dict[str, Any], message: str
) -> None:
    raw = {
        "stages": {"asr": {"backend": "test"}, "llm": {"backend": "test"}},
        "routes": {"text": ["asr", "llm"]},
        "scheduling": scheduling,
    }
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        engine_config(raw)


def test_capacity_comes_from_the_backend_unless_the_config_says() -> None:
    batching = BatchTestStage(TestStageOptions(role="llm", max_batch=6), "llm")

    class OneAtATime:
        options = None

    assert replica_capacity(batching) == 6
    assert replica_capacity(OneAtATime()) == 1

    class Pool:
        def __init__(self, *replicas: Any) -> None:
            self.replicas = list(replicas)

    pools = {"llm": Pool(batching, batching), "asr": Pool(OneAtATime())}
    # a one-slot stage under the default reserve of 1 could never run anything beside
    # real-time work: refused, naming the knob (issue 38)
    refused = r"^engine\.scheduling\.reserve: 1 slot\(s\) .*'asr' has 1"
    with pytest.raises(ConfigError, match=refused):
        make_scheduler(SchedulingConfig(policy="capacity"), pools, lambda _: False)
    one = SchedulingConfig(policy="capacity", reserves={"asr": 0})
    sched = make_scheduler(one, pools, lambda _: False)
    assert isinstance(sched, CapacityScheduler)
    assert {n: s["capacity"] for n, s in sched.snapshot().items()} == {"llm": 12, "asr": 1}
    sched = make_scheduler(
        SchedulingConfig(policy="capacity", capacity={"asr": 9}), pools, lambda _: False
    )
    assert sched.snapshot()["asr"]["capacity"] == 9
    assert isinstance(make_scheduler(SchedulingConfig(), pools, lambda _: False), SerialScheduler)


def test_request_kinds() -> None:
    assert request_kind(_llm("sess_a/e0/t1/r1/llm")) == "realtime"
    assert request_kind(_llm("sess_a/e2/draft7/llm")) == "draft"
    assert request_kind(_llm("batch/x/llm", Priority.BATCH)) == "batch"
    asr = AsrRequest(request_id="sess_a/asr/t1/0", audio=b"", priority=Priority.SPECULATIVE)
    assert request_kind(asr) == "speculative"


# ----------------------------------------------------------------------------- the policy
def test_serial_runs_one_batch_job_at_a_time_and_its_chained_stages_together() -> None:
    """A batch job's stage requests share its slot: on the talker route the codec's first
    window runs while the talker still samples the segment (it used to wait for the whole
    segment, so batch speech on that route did not stream); another job waits for the
    slot until every request of the first has ended."""

    async def main() -> None:
        sched = SerialScheduler(SchedulingConfig(), {"talker": 1, "codec": 1}, lambda _: False)
        order: list[str] = []
        talker_ends, codec_ends = asyncio.Event(), asyncio.Event()

        async def req(stage: str, rid: str, until: asyncio.Event) -> None:
            async with sched.slot(stage, _llm(rid, Priority.BATCH)):
                order.append(rid)
                await until.wait()

        talker = asyncio.create_task(req("talker", "batch/a/talker0", talker_ends))
        await asyncio.sleep(0)
        codec = asyncio.create_task(req("codec", "batch/a/codec0", codec_ends))
        other = asyncio.create_task(req("talker", "batch/b/talker0", asyncio.Event()))
        await asyncio.sleep(0.01)
        # job a's codec window runs beside its talker; job b waits for a's slot
        assert order == ["batch/a/talker0", "batch/a/codec0"]
        assert sched.admission.jobs == 1
        talker_ends.set()
        await talker
        await asyncio.sleep(0.01)
        assert order == ["batch/a/talker0", "batch/a/codec0"]  # a's codec still holds it
        codec_ends.set()
        await codec
        await asyncio.sleep(0.01)
        assert order[-1] == "batch/b/talker0" and sched.admission.jobs == 1
        other.cancel()
        await asyncio.gather(other, return_exceptions=True)
        assert sched.admission.jobs == 0

    run(main())


def test_capacity_admits_batch_while_room_remains_and_yields_to_waiting_realtime() -> None:
    async def main() -> None:
        sched = CapacityScheduler(
            SchedulingConfig(policy="capacity", reserve=0), {"llm": 2}, lambda _: False
        )
        order: list[str] = []

        async def batch(name: str, hold: asyncio.Event) -> None:
            async with sched.slot("llm", _llm(f"batch/{name}/llm", Priority.BATCH)):
                order.append(name)
                await hold.wait()

        # a batch request starts at once on an idle stage with room
        release_b1 = asyncio.Event()
        b1 = asyncio.create_task(batch("b1", release_b1))
        await asyncio.sleep(0)
        assert order == ["b1"] and sched.waits == 0
        # a real-time request arrives and waits for its first output: batch work holds back
        rt = sched.slot("llm", _llm("sess_a/e0/t1/r1/llm"))
        ticket = await rt.__aenter__()
        assert sched.snapshot()["llm"]["realtime_waiting"] == 1
        assert not sched.may_guess("sess_b", ["llm"]) and not sched.may_draft("sess_b", ["llm"])
        release_b2 = asyncio.Event()
        b2 = asyncio.create_task(batch("b2", release_b2))
        await asyncio.sleep(0.01)
        assert order == ["b1"] and sched.waits == 1
        # its first output is out, but the stage is full (b1 + the real-time request)
        ticket.output()
        await asyncio.sleep(0.01)
        assert order == ["b1"]
        assert not sched.may_guess("sess_b", ["llm"])
        # b1 ends: room again, b2 runs beside the real-time request
        release_b1.set()
        await b1
        await asyncio.sleep(0.01)
        assert order == ["b1", "b2"]
        snap = sched.snapshot()["llm"]
        assert (snap["load"], snap["batch"], snap["realtime"]) == (2, 1, 1)
        release_b2.set()
        await b2
        await rt.__aexit__(None, None, None)
        assert sched.may_guess("sess_b", ["llm"]) and sched.may_draft("sess_b", ["llm"])
        assert sched.snapshot()["llm"]["load"] == 0

    run(main())


def test_capacity_limits_batch_concurrency_and_keeps_the_reserve() -> None:
    async def main() -> None:
        sched = CapacityScheduler(
            SchedulingConfig(policy="capacity", reserve=1, batch_concurrency=2),
            {"tts": 8},
            lambda _: False,
        )
        hold = asyncio.Event()
        running: list[int] = []

        async def batch(i: int) -> None:
            req = TtsRequest(request_id=f"batch/{i}/tts0", text="x", priority=Priority.BATCH)
            async with sched.slot("tts", req):
                running.append(i)
                await hold.wait()

        tasks = [asyncio.create_task(batch(i)) for i in range(4)]
        await asyncio.sleep(0.01)
        assert len(running) == 2  # batch_concurrency
        hold.set()
        await asyncio.gather(*tasks)
        assert sorted(running) == [0, 1, 2, 3]
        # the reserve: with 7 of 8 slots taken, a guess may not start
        sched2 = CapacityScheduler(
            SchedulingConfig(policy="capacity", reserve=1), {"asr": 2}, lambda _: False
        )
        async with sched2.slot("asr", AsrRequest(request_id="batch/x/asr", audio=b"")):
            assert not sched2.may_guess("sess_a", ["asr"])
        assert sched2.may_guess("sess_a", ["asr"])

    run(main())


def test_a_full_stage_asks_drafts_to_yield_to_a_realtime_request() -> None:
    async def main() -> None:
        sched = CapacityScheduler(
            SchedulingConfig(policy="capacity", reserve=0), {"llm": 1}, lambda _: False
        )
        asked: list[tuple[str, int]] = []
        sched.yield_drafts = lambda stage, n: asked.append((stage, n))
        async with sched.slot("llm", _llm("sess_a/e0/draft0/llm")):
            assert sched.draft_requests("llm") == ["sess_a/e0/draft0/llm"]
            async with sched.slot("llm", _llm("sess_b/e0/t1/r1/llm")):
                await asyncio.sleep(0)
                assert asked == [("llm", 1)]
        # serial never asks: its turns drop every other draft when they start
        serial = SerialScheduler(SchedulingConfig(), {"llm": 1}, lambda _: True)
        serial.yield_drafts = lambda stage, n: asked.append((stage, n))
        async with serial.slot("llm", _llm("sess_a/e0/draft0/llm")):
            async with serial.slot("llm", _llm("sess_b/e0/t1/r1/llm")):
                await asyncio.sleep(0)
        assert asked == [("llm", 1)] and serial.turn_drops_drafts()
        assert not serial.may_guess("sess_a", []) and not serial.may_draft("sess_a", [])

    run(main())


# ----------------------------------------------------------------------------- in the engine
async def _slow_turn(engine: AsyncEngine, orch: Orchestrator) -> tuple[str, Any]:
    b = await engine.call(OpenCall())
    assert b.session_id and b.accepted_fence
    await engine.call(AppendCall(fence=b.accepted_fence, lease_generation=1, text="hello"))
    await engine.call(CommitCall(fence=b.accepted_fence, lease_generation=1))
    for _ in range(200):
        if orch.runners.turn_running(besides=""):
            break
        await asyncio.sleep(0.01)
    return b.session_id, b.accepted_fence


def test_capacity_guesses_and_drafts_while_another_sessions_turn_runs() -> None:
    """The serial rule (tests/engine/test_drafts.py) skips this pause; by capacity the
    stages have room, so it is guessed and answered ahead, and the other turn drops
    nothing."""

    async def main() -> None:
        backends = stages(asr_delay_s=0.05, token_interval_s=0.05 * UNIT)
        engine = await open_engine(_cfg(policy="capacity"), backends)
        try:
            orch = _orch(engine)
            a = await engine.call(OpenCall())
            assert a.session_id and a.accepted_fence
            b_sid, _ = await _slow_turn(engine, orch)
            await collect(engine, b_sid, lambda e: isinstance(e, AudioChunk), 10 * UNIT)
            assert orch.runners.turn_running(besides=a.session_id)
            await engine.call(AppendCall(fence=a.accepted_fence, lease_generation=1, audio=SPEECH))
            await engine.call(
                SignalCall(fence=a.accepted_fence, lease_generation=1, event="input.pause")
            )
            await asyncio.sleep(0.1)
            assert orch.speculation is not None
            assert (orch.speculation.started, orch.speculation.skipped) == (1, 0)
            assert orch.counters.drafts["started"] == 1 and a.session_id in _drafts(orch)
            await collect(engine, b_sid, lambda e: isinstance(e, ResponseDone), 20 * UNIT)
            assert a.session_id in _drafts(orch) and orch.counters.drafts["dropped"] == 0
            # a's commit adopts the draft it made while b's turn ran
            await engine.call(AppendCall(fence=a.accepted_fence, lease_generation=1, audio=SILENCE))
            await engine.call(CommitCall(fence=a.accepted_fence, lease_generation=1))
            evs = await collect(
                engine, a.session_id, lambda e: isinstance(e, ResponseDone), 20 * UNIT
            )
            assert isinstance(evs[-1], ResponseDone) and evs[-1].status == "completed"
            assert orch.counters.drafts["used"] == 1
        finally:
            await engine.shutdown()

    run(main())


def test_capacity_drops_a_draft_that_holds_a_full_stage_a_real_turn_needs() -> None:
    async def main() -> None:
        reply = " ".join(f"word{i}" for i in range(60))  # a long draft: 3 s of tokens
        backends = stages(asr_delay_s=0.02, token_interval_s=0.05 * UNIT, reply=reply)
        cfg = _cfg(policy="capacity", reserve=0, capacity={"llm": 1})
        engine = await open_engine(cfg, backends)
        try:
            orch = _orch(engine)
            a = await engine.call(OpenCall())
            assert a.session_id and a.accepted_fence
            await engine.call(AppendCall(fence=a.accepted_fence, lease_generation=1, audio=SPEECH))
            await engine.call(
                SignalCall(fence=a.accepted_fence, lease_generation=1, event="input.pause")
            )
            assert orch.scheduler is not None
            for _ in range(200):  # the draft now holds the LLM's only slot
                if orch.scheduler.snapshot()["llm"]["draft"] == 1:
                    break
                await asyncio.sleep(0.01)
            assert orch.scheduler.snapshot()["llm"]["draft"] == 1
            b_sid, _ = await _slow_turn(engine, orch)
            evs = await collect(engine, b_sid, lambda e: isinstance(e, AudioChunk), 10 * UNIT)
            assert isinstance(evs[-1], AudioChunk)
            assert orch.counters.drafts_yielded == 1 and orch.counters.drafts["dropped"] == 1
            assert a.session_id not in _drafts(orch)
            assert orch.scheduler.snapshot()["llm"]["draft"] == 0
        finally:
            await engine.shutdown()

    run(main())


def test_batch_speech_on_the_talker_route_streams_under_the_serial_policy() -> None:
    """POST /v1/audio/speech on ``[talker, codec]`` with the CPU rules: the first audio
    comes out while the talker still samples the segment (the codec's first window of 4
    frames shares the job's batch slot), not after the segment's last frame."""

    async def main() -> None:
        cfg = engine_config(
            {
                "stages": {
                    "talker": {"backend": "test", "options": {"token_interval_s": 0.1}},
                    "codec": {"backend": "test"},
                },
                "routes": {"speech": ["talker", "codec"]},
                "segmenter": {"first_min_words": 12, "first_max_words": 12},
                "scheduling": {"policy": "serial"},
            }
        )
        engine = await AsyncEngine.start(cfg)
        try:
            words = " ".join(f"word{i}" for i in range(12))  # one segment: 12 frames, 1.2 s
            t0 = asyncio.get_running_loop().time()
            first: float | None = None
            async for item in engine.generate(SpeechJob(text=words)):
                if isinstance(item, AudioOut) and first is None:
                    first = asyncio.get_running_loop().time() - t0
            total = asyncio.get_running_loop().time() - t0
            # the first window is ready after 4 of the 12 frames (0.4 s); before, it waited
            # for the 12th (1.2 s). Frames are 0.1 s apart: the gap is 8 frames wide.
            assert first is not None and total >= 1.2
            assert first < total - 0.4, (first, total)
        finally:
            await engine.shutdown()

    run(main())


@pytest.mark.parametrize("policy", ["serial", "capacity"])
def test_batch_beside_a_turn_waiting_for_its_first_audio(policy: str) -> None:
    """serial: the batch request waits until the session's first audio is out; capacity:
    the TTS stage it needs has room and no real-time request waits there, so it runs."""

    async def main() -> None:
        engine = await open_engine(_cfg(policy=policy), stages(asr_delay_s=0.3))
        try:
            res = await engine.call(OpenCall())
            sid, f = res.session_id, res.accepted_fence
            assert sid and f
            await engine.call(AppendCall(fence=f, lease_generation=1, audio=b"\1\0" * 1600))
            # the turn is now in its ASR (0.3 s)
            await engine.call(CommitCall(fence=f, lease_generation=1))
            await asyncio.sleep(0.05)
            order: list[str] = []

            async def batch() -> None:
                async for item in engine.generate(SpeechJob(text="batch words here")):
                    if isinstance(item, AudioOut) and "batch" not in order:
                        order.append("batch")

            async def session() -> None:
                async for ev in engine.session_events(sid):
                    if isinstance(ev, AudioChunk) and "session" not in order:
                        order.append("session")
                    if isinstance(ev, ResponseDone):
                        return

            await asyncio.wait_for(asyncio.gather(batch(), session()), 10 * UNIT)
            orch = _orch(engine)
            if policy == "serial":
                assert order == ["session", "batch"] and orch.admission.waits >= 1
            else:
                assert order == ["batch", "session"] and orch.admission.waits == 0
            assert orch.admission.critical == 0
        finally:
            await engine.shutdown()

    run(main())
