"""The vLLM stages' shared parts without vLLM: a request's stream back to the orchestrator's
loop, a replica's placement, and the engine's request loop over a fake ``AsyncLLM``
(engine/stages/vllm_loop.py, vllm_env.py, vllm_engine.py). The real engine runs in the vLLM
tier (tests/vllm)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from duplex_contract.batch import TextOut
from duplex_contract.errors import ConfigError, StageError
from engine.messages import LlmRequest, Priority, StageDone, StageOutput
from engine.stages.vllm_engine import VllmEngine
from engine.stages.vllm_env import VllmPlacement
from engine.stages.vllm_loop import RequestStream
from engine.stages.vllm_options import VllmOptions
from tests.engine.conftest import run

CVD = "CUDA_VISIBLE_DEVICES"


async def outputs(stream: RequestStream) -> list[StageOutput]:
    return [out async for out in stream.outputs()]


def test_a_stream_ends_at_its_stage_done_and_an_abort_drops_what_comes_later() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        stream = RequestStream(request_id="r", loop=loop)
        stream.deliver(TextOut(request_id="r", text="a"))
        stream.deliver(StageDone(request_id="r"))
        stream.deliver(TextOut(request_id="r", text="never"))  # after its StageDone
        stream.finish()
        assert await outputs(stream) == [TextOut("r", "a"), StageDone(request_id="r")]

        aborted = RequestStream(request_id="x", loop=loop)
        aborted.end(StageDone(request_id="x", finish_reason="aborted"))
        aborted.end(StageDone(request_id="x"))  # ended once
        aborted.deliver(TextOut(request_id="x", text="late"))
        assert await outputs(aborted) == [StageDone(request_id="x", finish_reason="aborted")]

        failed = RequestStream(request_id="f", loop=loop)
        failed.fail(StageError("gone", code="worker_died"))
        with pytest.raises(StageError, match="gone"):
            await outputs(failed)

    run(main())


def test_placement_pins_gpus_and_refuses_a_device_vllm_does_not_run_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(CVD, raising=False)
    opts = VllmOptions()

    def place(device: str, count: int) -> VllmPlacement:
        return VllmPlacement(opts, name="llm1", stage="llm", device=device, cuda_count=count)

    pinned = place("cuda:1", 2)
    assert pinned.gpus == (1,) and pinned.start_devices() == {"cuda:1"}
    assert pinned.env("cuda") == {CVD: "1"}
    monkeypatch.setenv(CVD, "4,6")  # this process sees two GPUs: the child gets the second
    assert pinned.env("cuda") == {CVD: "6"}
    auto = place("auto", 2)
    assert auto.gpus is None and auto.start_devices() == {"cuda:0", "cuda:1"}
    assert auto.env("cpu") == {}  # vLLM places itself
    cpu = place("cpu", 0)
    assert cpu.start_devices() == frozenset() and cpu.env("cpu") == {}
    with pytest.raises(ConfigError, match=r"^engine\.stages\.llm\.devices: replica llm1 is"):
        cpu.env("cuda")


@dataclass
class _Completion:
    token_ids: list[int]
    text: str = ""
    finish_reason: str | None = None


@dataclass
class _Output:
    outputs: list[_Completion]
    finished: bool = False


@dataclass
class _FakeLlm:
    """``AsyncLLM.generate`` as the engine uses it: steps, then a finish reason (or a raise)."""

    steps: list[_Output]
    error: Exception | None = None
    seen: list[tuple[str, int]] = field(default_factory=list)

    async def generate(
        self, prompt: Any, params: Any, rid: str, priority: int = 0
    ) -> AsyncIterator[_Output]:
        self.seen.append((rid, priority))
        for step in self.steps:
            yield step
        if self.error is not None:
            raise self.error


class EngineDeadError(Exception):
    """Named as vLLM's: a dead EngineCore."""


class _Model:
    def resolve_model(self) -> str:
        return "m"

    def engine_args(self) -> dict[str, Any]:
        return {}

    async def warm_up(self, model: str) -> None:
        pass


def _engine(llm: _FakeLlm) -> VllmEngine:
    opts = VllmOptions()
    place = VllmPlacement(opts, name="llm", stage="llm", device="cpu", cuda_count=0)
    engine = VllmEngine(opts, "llm", stage="llm", placement=place, model=_Model())
    engine.llm = llm
    return engine


async def _generate(llm: _FakeLlm, each: Any = None) -> list[StageOutput]:
    engine = _engine(llm)
    request = LlmRequest(request_id="s/e0/llm", messages=(), priority=Priority.BATCH)
    stream = RequestStream(request_id=request.request_id, loop=asyncio.get_running_loop())

    def count(completion: _Completion) -> None:
        stream.tokens += len(completion.token_ids)
        if completion.text:
            stream.deliver(TextOut(request_id=request.request_id, text=completion.text))

    await engine.generate_into(stream, request, lambda: ("p", "params", 5), each or count)
    assert llm.seen == [("s/e0/llm", int(Priority.BATCH))]  # priority scheduling: its own
    return await outputs(stream)


def test_the_request_loop_streams_and_ends_with_the_finish_reason() -> None:
    async def main() -> None:
        steps = [
            _Output([_Completion([1], "Hi")]),
            _Output([_Completion([2, 3], " there", "length")], finished=True),
        ]
        got = await _generate(_FakeLlm(steps))
        assert got == [
            TextOut("s/e0/llm", "Hi"),
            TextOut("s/e0/llm", " there"),
            StageDone("s/e0/llm", finish_reason="length", tokens=3, prompt_tokens=5),
        ]
        aborted = await _generate(_FakeLlm([_Output([_Completion([], "", "abort")], True)]))
        assert aborted == [StageDone("s/e0/llm", finish_reason="aborted", prompt_tokens=5)]
        with pytest.raises(StageError, match="request ended with 'weird'"):
            await _generate(_FakeLlm([_Output([_Completion([], "", "weird")], True)]))

    run(main())


def test_a_dead_engine_fails_the_request_in_words_and_marks_the_replica_down() -> None:
    async def main() -> None:
        llm = _FakeLlm([], error=EngineDeadError("boom"))
        engine = _engine(llm)
        request = LlmRequest(request_id="r", messages=())
        stream = RequestStream(request_id="r", loop=asyncio.get_running_loop())
        await engine.generate_into(stream, request, lambda: ("p", "params", 1), lambda c: None)
        with pytest.raises(StageError) as info:
            await outputs(stream)
        assert info.value.code == "worker_died" and "vLLM EngineCore died" in str(info.value)
        assert (engine.supervisor.health() or "").startswith("llm: vLLM EngineCore died")

        def refuse(completion: _Completion) -> None:
            raise StageError("llm: not a frame", code="stage_failed")

        with pytest.raises(StageError, match="not a frame"):
            await _generate(_FakeLlm([_Output([_Completion([9])])]), each=refuse)

    run(main())
