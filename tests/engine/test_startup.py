"""Stage start-up (engine/startup.py): one stage at a time per GPU, GPUs in parallel, one
deadline that names the stage that hangs."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
import pytest

from duplex_contract.errors import ConfigError, StageError
from engine.api.client import AsyncEngine
from engine.stages.base import StageBackend
from engine.stages.pool import StagePool
from engine.stages.testing import TestStage, TestStageOptions
from engine.startup import start_devices, start_pools
from tests.engine.conftest import UNIT, make_config, run, stages


class TimedStage(TestStage):
    """A test stage on a given device that records when its start began and ended."""

    __test__ = False

    def __init__(self, name: str, device: str, delay_s: float, fail: bool = False) -> None:
        super().__init__(TestStageOptions(), name, device=device, stage="llm")
        self.delay_s = delay_s
        self.fail = fail
        self.began: float | None = None
        self.ended: float | None = None

    async def start(self) -> None:
        self.began = time.monotonic()
        await asyncio.sleep(self.delay_s)
        if self.fail:
            raise StageError(f"{self.name}: load failed: injected")
        self.ended = time.monotonic()


def _overlap(a: TimedStage, b: TimedStage) -> bool:
    assert a.began is not None and a.ended is not None
    assert b.began is not None and b.ended is not None
    return a.began < b.ended and b.began < a.ended


def pools(**replicas: list[TimedStage]) -> dict[str, StagePool]:
    out: dict[str, StagePool] = {}
    for name, reps in replicas.items():
        built: list[StageBackend] = list(reps)
        out[name] = StagePool(name, built)
    return out


def test_one_stage_at_a_time_per_gpu_and_gpus_in_parallel() -> None:
    d = 0.15 * UNIT
    asr = TimedStage("asr", "cuda:0", d)
    llm0 = TimedStage("llm0", "cuda:0", d)
    llm1 = TimedStage("llm1", "cuda:1", d)
    tts = TimedStage("tts", "cuda:0", d)
    vad = TimedStage("vad", "cpu", d)
    records = run(start_pools(pools(asr=[asr], llm=[llm0, llm1], tts=[tts], vad=[vad]), 10 * UNIT))
    # cuda:0 in config order, each after the one before it has started
    assert asr.ended is not None and llm0.began is not None and llm0.began >= asr.ended
    assert llm0.ended is not None and tts.began is not None and tts.began >= llm0.ended
    # another GPU and the CPU do not wait for cuda:0
    assert _overlap(asr, llm1) and _overlap(asr, vad)
    assert [r.replica for r in records] == ["asr", "llm0", "llm1", "tts", "vad"]
    assert all(r.ready_at is not None for r in records)


def test_a_replica_on_two_gpus_waits_for_both() -> None:
    class TwoGpus(TimedStage):
        def start_devices(self) -> frozenset[str]:
            return frozenset({"cuda:0", "cuda:1"})

    d = 0.15 * UNIT
    a = TimedStage("a", "cuda:0", d)
    b = TimedStage("b", "cuda:1", 2 * d)
    both = TwoGpus("both", "auto", d)
    c = TimedStage("c", "cuda:1", d)
    run(start_pools(pools(a=[a], b=[b], both=[both], c=[c]), 10 * UNIT))
    assert both.began is not None and b.ended is not None and both.began >= b.ended
    assert c.began is not None and both.ended is not None and c.began >= both.ended
    assert start_devices(both) == {"cuda:0", "cuda:1"}
    assert start_devices(TimedStage("x", "cuda", 0)) == {"cuda:0"}
    assert start_devices(TimedStage("y", "cpu", 0)) == frozenset()


def test_the_deadline_names_the_stage_that_hangs_and_the_ones_behind_it() -> None:
    hung = TimedStage("talker", "cuda:0", 60.0)
    behind = TimedStage("codec", "cuda:0", 0.0)
    fine = TimedStage("asr", "cpu", 0.0)
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as err:
        run(start_pools(pools(talker=[hung], codec=[behind], asr=[fine]), 0.3 * UNIT))
    assert time.monotonic() - t0 < 5 * UNIT
    msg = str(err.value)
    assert msg.startswith("engine.start_timeout_s: the stages did not start within 0.3 s")
    assert "stage 'talker' (replica talker on cuda:0) still starting after 0." in msg
    assert "queued behind it: codec (cuda:0)" in msg
    assert "asr" not in msg  # it started
    assert behind.began is None  # never started


def test_the_first_failure_fails_the_start_and_cancels_the_rest() -> None:
    bad = TimedStage("bad", "cuda:0", 0.05 * UNIT, fail=True)
    slow = TimedStage("slow", "cpu", 60.0)
    with pytest.raises(StageError, match="bad: load failed: injected"):
        run(start_pools(pools(bad=[bad], slow=[slow]), 30 * UNIT))
    assert slow.ended is None


def test_engine_start_fails_naming_the_stage_past_start_timeout() -> None:
    cfg = msgspec.structs.replace(make_config(), start_timeout_s=0.3 * UNIT)
    backends: dict[str, Any] = stages()
    backends["llm"] = [TestStage(TestStageOptions(load_delay_s=60.0), "llm")]

    async def go() -> None:
        with pytest.raises(ConfigError, match=r"stage 'llm' \(replica llm on no GPU\) still"):
            await AsyncEngine.start(cfg, backends)

    run(go())


def test_start_timeout_is_validated() -> None:
    from engine.config import engine_config, load_yaml
    from tests.engine.conftest import ROOT

    raw = load_yaml(ROOT / "configs" / "test.yaml")["engine"]
    with pytest.raises(ConfigError, match=r"engine\.start_timeout_s: Expected `float` > 0"):
        engine_config({**raw, "start_timeout_s": 0})
    assert engine_config(raw).start_timeout_s == 1800.0
    assert engine_config({**raw, "start_timeout_s": None}).start_timeout_s is None
