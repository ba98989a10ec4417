"""The ``capacity`` policy as a GPU user meets it (issue 38; engine/orchestration/capacity.py):
single-slot stages, batch admission by job with a minimum share and a bounded wait, the
real-time budget from a stage's pace, drafts below real-time work, and the figures
``/metrics`` shows."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from duplex_contract.batch import AudioOut, SpeechJob
from duplex_contract.errors import ConfigError, StageError
from engine.api.client import AsyncEngine
from engine.config import SchedulingConfig, engine_config
from engine.messages import AsrRequest, LlmRequest, Priority, TtsRequest
from engine.orchestration.capacity import CapacityScheduler
from engine.orchestration.drafts import Draft
from engine.orchestration.policies import make_scheduler
from engine.orchestration.scheduling import SerialScheduler
from engine.pipeline.graph import build_graph
from engine.stage_figures import Pace
from engine.stages.openai_remote import OpenAIOptions, OpenAIStage
from engine.stages.sim import SimOptions, SimStage
from engine.stages.talker_remote import RemoteTalker, RemoteTalkerOptions
from engine.stages.testing import TestStage, TestStageOptions
from tests.engine.conftest import UNIT, run
from tests.server.harness import running_server, write_config


def _cap(**kw: Any) -> SchedulingConfig:
    return SchedulingConfig(policy="capacity", **kw)


def _req(rid: str, priority: Priority = Priority.REALTIME) -> LlmRequest:
    return LlmRequest(request_id=rid, messages=(), priority=priority)


class _Pool:
    def __init__(self, *replicas: Any) -> None:
        self.replicas = list(replicas)


# ----------------------------------------------------------------------------- slots
def test_remote_stages_declare_their_pool_size_as_capacity() -> None:
    remote = OpenAIStage(OpenAIOptions(base_url="http://x/v1", pool_size=24), "llm")
    talker = RemoteTalker(RemoteTalkerOptions(base_url="http://x/v1", pool_size=256), "talker")
    sched = make_scheduler(_cap(), {"llm": _Pool(remote), "talker": _Pool(talker)}, lambda _: 0)
    assert {n: s["capacity"] for n, s in sched.snapshot().items()} == {"llm": 24, "talker": 256}


def test_a_reserve_that_leaves_a_stage_no_slot_is_refused_before_any_model_loads() -> None:
    raw = {
        "stages": {"tts": {"backend": "test", "options": {"max_batch": 1}}},
        "routes": {"speech": ["tts"]},
        "scheduling": {"policy": "capacity"},
    }
    with pytest.raises(
        ConfigError, match=r"^engine\.scheduling\.reserve: 1 slot\(s\).*'tts' has 1"
    ):
        build_graph(engine_config(raw))
    raw["scheduling"] = {"policy": "capacity", "reserves": {"tts": 1}, "capacity": {"tts": 1}}
    with pytest.raises(ConfigError, match=r"^engine\.scheduling\.reserves\.tts: 1 slot"):
        build_graph(engine_config(raw))
    raw["scheduling"] = {"policy": "capacity", "reserves": {"tts": 0}}
    build_graph(engine_config(raw))  # one slot, no reserve: fine
    raw["scheduling"] = {"policy": "serial"}  # the serial rules count no slots
    build_graph(engine_config({**raw, "scheduling": {"policy": "serial"}}))
    with pytest.raises(ConfigError, match=r"scheduling\.reserves\.nope: no such stage"):
        engine_config({**raw, "scheduling": {"reserves": {"nope": 0}}})


def test_a_single_slot_stage_serves_batch_and_guesses() -> None:
    """A one-request-at-a-time stage (a remote ASR with pool_size 1, a one-replica worker)
    with no reserve: a pause is guessed and a batch request runs while it is idle."""

    async def main() -> None:
        sched = CapacityScheduler(_cap(reserves={"asr": 0}), {"asr": 1}, lambda _: False)
        assert sched.may_guess("sess_a", ["asr"]) and sched.may_draft("sess_a", ["asr"])
        batch = AsrRequest(request_id="batch/t1/asr", audio=b"", priority=Priority.BATCH)
        async with sched.slot("asr", batch):
            assert sched.snapshot()["asr"]["batch"] == 1
            assert not sched.may_guess("sess_a", ["asr"])  # its one slot is taken
        assert sched.waits == 0 and sched.may_guess("sess_a", ["asr"])

    run(main())


# ----------------------------------------------------------------------------- batch
def test_batch_admission_counts_jobs_not_stage_requests() -> None:
    """batch_concurrency 1: job a's codec window starts beside its talker segment (they
    share the job's place); job b waits until a's last request ends."""

    async def main() -> None:
        sched = CapacityScheduler(_cap(batch_concurrency=1), {"talker": 8, "codec": 8}, bool)
        order: list[str] = []
        hold = {k: asyncio.Event() for k in ("a_talker", "a_codec")}

        async def req(stage: str, rid: str, until: asyncio.Event) -> None:
            async with sched.slot(stage, _req(rid, Priority.BATCH)):
                order.append(rid)
                await until.wait()

        ta = asyncio.create_task(req("talker", "batch/a/talker0", hold["a_talker"]))
        await asyncio.sleep(0)
        ca = asyncio.create_task(req("codec", "batch/a/codec0", hold["a_codec"]))
        tb = asyncio.create_task(req("talker", "batch/b/talker0", asyncio.Event()))
        await asyncio.sleep(0.05)
        assert order == ["batch/a/talker0", "batch/a/codec0"]
        assert sched.admission.jobs == {"batch/a": 2}
        hold["a_talker"].set()
        hold["a_codec"].set()
        await asyncio.gather(ta, ca)
        await asyncio.sleep(0.05)
        assert order[-1] == "batch/b/talker0"
        tb.cancel()
        await asyncio.gather(tb, return_exceptions=True)
        assert sched.admission.jobs == {}

    run(main())


def _rt_held(sched: Any, stage: str, rid: str) -> Any:
    """A real-time request of ``stage`` that has not produced its first output."""
    return sched.slot(stage, _req(rid))


def test_the_minimum_share_lets_an_aged_batch_request_in_beside_waiting_realtime() -> None:
    async def main() -> None:
        cfg = _cap(reserve=0, batch_age_s=0.3, batch_wait_s=5.0)
        sched = CapacityScheduler(cfg, {"talker": 4}, lambda _: False)
        async with _rt_held(sched, "talker", "sess_a/e0/t1/r1/talker0"):
            # a real-time request waits for its first output: no spare room
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            async with sched.slot("talker", _req("batch/x/talker0", Priority.BATCH)):
                waited = loop.time() - t0
                fig = sched.figures()["talker"]
                assert fig.batch_aged == 1 and fig.batch_waits == 1
                # ... a second one waits: the share is one batch request at a time
                second = asyncio.create_task(
                    sched.slot("talker", _req("batch/y/talker0", Priority.BATCH)).__aenter__()
                )
                await asyncio.sleep(0.5)
                assert not second.done()
                second.cancel()
                await asyncio.gather(second, return_exceptions=True)
        assert 0.3 <= waited < 0.3 + 4 * 0.25 + 0.5
        assert sum(sched.figures()["talker"].wait_buckets) == 1

    run(main())


@pytest.mark.parametrize("policy", ["capacity", "serial"])
def test_a_batch_wait_ends_with_server_busy_at_its_bound(policy: str) -> None:
    """Every batch wait is bounded: a full stage (capacity) or a session waiting for its
    first audio (serial) hold it back, and at ``batch_wait_s`` it fails, retryable."""

    async def main() -> None:
        cfg = SchedulingConfig(policy=policy, reserve=0, batch_wait_s=0.3)  # type: ignore[arg-type]
        sched = make_scheduler(
            cfg, {"tts": _Pool(TestStage(TestStageOptions(max_batch=1), "tts"))}, bool
        )
        loop = asyncio.get_running_loop()
        sched.enter_critical("sess_a/e0/t1/r1")
        async with sched.slot("tts", _req("sess_a/e0/t1/r1/tts0")):
            t0 = loop.time()
            with pytest.raises(StageError) as err:
                req = TtsRequest(request_id="batch/x/tts0", text="x", priority=Priority.BATCH)
                async with sched.slot("tts", req):
                    pass
            assert 0.29 <= loop.time() - t0 < 0.3 + 1.0
        assert err.value.code == "server_busy" and err.value.retryable
        assert "engine.scheduling.batch_wait_s" in err.value.message
        fig = sched.figures()["tts"]
        assert fig.batch_timeouts == 1 and fig.batch_waiting == 0
        assert sched.snapshot()["tts"]["load"] == 0

    run(main())


def test_a_busy_engine_answers_batch_speech_with_503_server_busy(tmp_path: Any) -> None:
    """Over HTTP: a slow chat job holds the only batch place (2 s of tokens); a speech
    request is refused with 503 ``server_busy`` after ``batch_wait_s``, not left hanging."""
    slow = {"token_interval_s": 0.2, "reply": " ".join(f"w{i}" for i in range(10))}
    cfg = write_config(
        tmp_path,
        {
            "stages": {"llm": {"backend": "test", "options": slow}},
            "scheduling": {"policy": "capacity", "batch_concurrency": 1, "batch_wait_s": 0.5},
        },
    )
    with running_server(cfg) as addr:

        async def main() -> None:
            async with httpx.AsyncClient(timeout=30 * UNIT) as client:
                chat = {"model": "x", "messages": [{"role": "user", "content": "hi"}]}
                slow_chat = asyncio.create_task(
                    client.post(f"http://{addr}/v1/chat/completions", json=chat)
                )
                await asyncio.sleep(0.3)
                loop = asyncio.get_running_loop()
                t0 = loop.time()
                resp = await client.post(
                    f"http://{addr}/v1/audio/speech",
                    json={"model": "x", "input": "hi", "voice": "test"},
                )
                assert resp.status_code == 503, (resp.status_code, resp.text[:300])
                assert loop.time() - t0 >= 0.5
                body = resp.json()["error"]
                assert body["code"] == "server_busy" and "batch_wait_s" in body["message"]
                assert (await slow_chat).status_code == 200  # it was never disturbed

        run(main())


def test_batch_speech_on_the_talker_route_streams_under_the_capacity_policy() -> None:
    """As the serial case in test_scheduling.py: ``[talker, codec]`` under ``capacity`` with
    one batch job at a time; the first audio comes out while the talker still samples."""

    async def main() -> None:
        cfg = engine_config(
            {
                "stages": {
                    "talker": {"backend": "test", "options": {"token_interval_s": 0.1}},
                    "codec": {"backend": "test"},
                },
                "routes": {"speech": ["talker", "codec"]},
                "segmenter": {"first_min_words": 12, "first_max_words": 12},
                "scheduling": {"policy": "capacity", "batch_concurrency": 1},
            }
        )
        engine = await AsyncEngine.start(cfg)
        try:
            words = " ".join(f"word{i}" for i in range(12))
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            first: float | None = None
            async for item in engine.generate(SpeechJob(text=words)):
                if isinstance(item, AudioOut) and first is None:
                    first = loop.time() - t0
            total = loop.time() - t0
            assert first is not None and total >= 1.2
            assert first < total - 0.4, (first, total)
        finally:
            await engine.shutdown()

    run(main())


# ----------------------------------------------------------------------------- time
class _Paced:
    def __init__(self) -> None:
        self.now: Pace | None = None

    def __call__(self) -> Pace | None:
        return self.now


def _paced(**kw: Any) -> tuple[CapacityScheduler, _Paced]:
    pace = _Paced()
    paces: dict[str, Callable[[], Pace | None]] = {"talker": pace}
    return CapacityScheduler(_cap(**kw), {"talker": 128}, lambda _: False, paces), pace


def test_a_stage_behind_real_time_takes_no_batch_work_however_many_slots_it_has() -> None:
    """Behind its real-time pace (or sharing a GPU with a stage that is) a stage admits no
    batch work, only the minimum share; guesses and drafts still run (the real-time path
    done ahead: a guess at the last pause is the commit's own transcription, its draft the
    turn's answer; they queue below real-time work)."""

    async def main() -> None:
        pace = _Paced()
        paces: dict[str, Callable[[], Pace | None]] = {"talker": pace}
        shared = {"talker": ["talker", "asr"], "asr": ["asr", "talker"], "codec": ["codec"]}
        caps = {"talker": 128, "asr": 16, "codec": 64}
        cfg = _cap(reserve=1, batch_wait_s=0.3, batch_age_s=10.0)
        sched = CapacityScheduler(cfg, caps, lambda _: False, paces, shared)
        pace.now = Pace(streams=40, rate=90.0, need=82.0)  # 1.1x: under the 1.2 margin
        assert sched.loads.behind("talker") and sched.loads.behind("asr")  # same GPU
        assert not sched.loads.behind("codec")
        assert sched.may_draft("sess_a", ["talker"]) and sched.may_guess("sess_a", ["asr"])
        for stage in ("talker", "asr"):
            with pytest.raises(StageError, match="busy"):
                async with sched.slot(stage, _req(f"batch/x/{stage}0", Priority.BATCH)):
                    pass
        async with sched.slot("codec", _req("batch/y/codec0", Priority.BATCH)):
            pass  # another GPU's stage
        pace.now = Pace(streams=40, rate=150.0, need=82.0)
        async with sched.slot("talker", _req("batch/z/talker0", Priority.BATCH)):
            pass
        assert sched.figures()["talker"].pace == pytest.approx(150 / 82, abs=1e-3)
        # the cost model's real-time limit caps the slots
        pace.now = Pace(streams=2, rate=150.0, need=82.0, limit=3)
        assert sched.figures()["talker"].limit == 3
        async with sched.slot("talker", _req("sess_b/e0/t1/r1/talker0")) as t:
            t.output()
            assert sched.may_draft("sess_a", ["talker"])  # 1 + reserve 1 < 3
            async with sched.slot("talker", _req("sess_c/e0/t1/r1/talker0")) as t2:
                t2.output()
                assert not sched.may_draft("sess_a", ["talker"])  # 2 + 1 = 3

    run(main())


def test_drafts_leave_a_stage_over_its_real_time_limit_for_a_realtime_request() -> None:
    async def main() -> None:
        sched, pace = _paced(reserve=0)
        asked: list[tuple[str, int]] = []
        sched.yield_drafts = lambda stage, n: asked.append((stage, n))
        pace.now = Pace(streams=1, rate=150.0, need=82.0, limit=2)
        draft = _req("sess_a/e0/draft0/talker0", Priority.DRAFT)
        async with sched.slot("talker", draft):
            async with sched.slot("talker", _req("sess_b/e0/t1/r1/talker0")):
                await asyncio.sleep(0)
                assert asked == []  # 2 of its 2 real-time slots: the draft stays
                async with sched.slot("talker", _req("sess_c/e0/t1/r1/talker0")):
                    await asyncio.sleep(0)
                    assert asked == [("talker", 1)]  # over by one: one draft leaves
        assert sched.figures()["talker"].drafts_yielded == 1

    run(main())


def test_a_drafts_outputs_count_as_used_or_wasted_by_how_it_ended() -> None:
    async def main() -> None:
        sched = CapacityScheduler(_cap(), {"llm": 8}, lambda _: False)
        for n, used in ((0, True), (1, False)):
            prefix = f"sess_a/e0/draft{n}"
            sched.tally.started(prefix)
            async with sched.slot("llm", _req(f"{prefix}/llm", Priority.DRAFT)) as t:
                for _ in range(3):
                    t.output()
                t.output(False)  # its StageDone: no work
            sched.tally.ended(prefix, used)
        # an adopted draft's later requests are real-time work of its turn
        async with sched.slot("llm", _req("sess_a/e0/draft0/tts0")) as t:
            assert t.kind == "realtime"
            t.output()
        async with sched.slot("llm", _req("sess_b/e0/t1/r1/llm")) as t:
            t.output()
        outputs = sched.figures()["llm"].outputs
        assert outputs["draft_used"] == 4 and outputs["draft_wasted"] == 3
        assert outputs["realtime"] == 1

    run(main())


def test_drafts_queue_behind_realtime_work_and_ahead_of_guesses() -> None:
    """In a stage's queue a draft (``Priority.DRAFT``) waits for every real-time request,
    however early it came, and goes before a guess and batch work (one sequence at a time
    on the simulated LLM: its queue is ordered by priority)."""

    async def main() -> None:
        stage = SimStage(SimOptions(role="llm", step_ms=5, max_num_seqs=1, reply="a b"), "llm")
        await stage.start()
        try:
            busy = _req("sess_x/e0/t1/r1/llm")
            queued = [
                _req("batch/b/llm", Priority.BATCH),
                _req("sess_y/e0/t1/r1/llm-guess", Priority.SPECULATIVE),
                _req("sess_a/e0/draft0/llm", Priority.DRAFT),
                _req("sess_b/e0/t1/r1/llm"),
            ]
            order: list[str] = []

            async def go(r: Any) -> None:
                async for _ in stage.submit(r):
                    pass
                order.append(r.request_id)

            first = asyncio.create_task(go(busy))
            await asyncio.sleep(0.002)
            rest = [asyncio.create_task(go(r)) for r in queued]
            await asyncio.gather(first, *rest)
            assert order == [
                "sess_x/e0/t1/r1/llm",
                "sess_b/e0/t1/r1/llm",
                "sess_a/e0/draft0/llm",
                "sess_y/e0/t1/r1/llm-guess",
                "batch/b/llm",
            ]
        finally:
            await stage.close()

    run(main())


def test_serial_keeps_its_rules_for_drafts() -> None:
    """The CPU rules are unchanged: under serial a real turn drops other sessions' drafts
    and no pause is guessed while another session's turn runs."""
    serial = SerialScheduler(SchedulingConfig(), {"llm": 1}, lambda besides: besides != "x")
    assert serial.turn_drops_drafts()
    assert not serial.may_guess("sess_a", ["llm"]) and serial.may_guess("x", ["llm"])


def test_a_drafts_requests_are_below_realtime_until_its_turn_adopts_it() -> None:
    draft = Draft("sess_a", 0, "sess_a/e0/draft0")
    assert draft.urgency() == Priority.DRAFT
    draft.adopt(lambda _: None, lambda _: None, lambda _: None)
    assert draft.urgency() == Priority.REALTIME  # its later requests are its turn's
    assert Priority.REALTIME < Priority.DRAFT < Priority.SPECULATIVE < Priority.BATCH
