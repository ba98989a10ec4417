"""The one-request-at-a-time runtime (ThreadedRuntime) and StagePool with a toy backend (no
models)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import msgspec
import pytest

from duplex_contract.batch import TextOut
from duplex_contract.errors import StageError
from engine.messages import LlmRequest, Priority, StageDone, StageOutput, StageRequest, TtsRequest
from engine.stages.pool import StagePool
from engine.stages.testing import TestStage, TestStageOptions
from engine.stages.threaded import ThreadedRuntime
from engine.stages.workers import WorkerCrash
from tests.engine.conftest import run


class ToyOptions(msgspec.Struct, frozen=True):
    interval_s: float = 0.0
    n: int = 5


class Toy:
    """A backend as the real ones are built: the model (``load``/``run``/``unload``) holding
    a ThreadedRuntime, which serves the stage interface."""

    Options = ToyOptions
    device = "cpu"

    def __init__(self, options: Any, name: str) -> None:
        self.options = options
        self.name = name
        self.loads = 0
        self.order: list[str] = []
        self.gate = threading.Event()
        self.gate.set()
        self.runtime = ThreadedRuntime(name, self)

    @property
    def restarts(self) -> int:
        return self.runtime.restarts

    async def start(self) -> None:
        await self.runtime.start()

    def submit(self, request: StageRequest) -> AsyncIterator[StageOutput]:
        return self.runtime.submit(request)

    async def abort(self, request_ids: Sequence[str]) -> None:
        await self.runtime.abort(request_ids)

    async def close(self) -> None:
        await self.runtime.close()

    def load(self) -> None:
        self.loads += 1

    def unload(self) -> None:
        pass

    def run(self, request: StageRequest, cancelled: threading.Event) -> Iterator[StageOutput]:
        assert isinstance(request, LlmRequest | TtsRequest)
        self.gate.wait(5)
        self.order.append(request.request_id)
        text = request.messages[0].content if isinstance(request, LlmRequest) else request.text
        if text == "raise":
            raise ValueError("bad input")
        if text == "crash":
            raise WorkerCrash("segfault stand-in")
        for i in range(self.options.n):
            if cancelled.is_set():
                return
            time.sleep(self.options.interval_s)
            yield TextOut(request_id=request.request_id, text=str(i))
        yield StageDone(request_id=request.request_id, tokens=self.options.n)


def llm(
    rid: str, text: str = "hi", priority: Priority = Priority.REALTIME, session: str | None = None
) -> LlmRequest:
    from duplex_contract.batch import ChatMessage

    return LlmRequest(
        request_id=rid, messages=(ChatMessage("user", text),), priority=priority, session_id=session
    )


async def drain(backend: Any, req: StageRequest) -> list[StageOutput]:
    return [o async for o in backend.submit(req)]


def test_outputs_stream_from_the_worker_thread() -> None:
    async def main() -> None:
        toy = Toy(ToyOptions(), "toy")
        await toy.start()
        try:
            outs = await drain(toy, llm("r1"))
            assert [o.text for o in outs if isinstance(o, TextOut)] == ["0", "1", "2", "3", "4"]
            assert isinstance(outs[-1], StageDone)
        finally:
            await toy.close()

    run(main())


def test_failure_is_per_request_and_crash_restarts_the_worker() -> None:
    async def main() -> None:
        toy = Toy(ToyOptions(), "toy")
        await toy.start()
        try:
            with pytest.raises(StageError) as info:
                await drain(toy, llm("bad", "raise"))
            assert info.value.code == "stage_failed"
            assert len(await drain(toy, llm("ok1"))) == 6
            with pytest.raises(StageError) as info:
                await drain(toy, llm("dead", "crash"))
            assert info.value.code == "worker_died"
            assert len(await drain(toy, llm("ok2"))) == 6  # served by the restarted worker
            assert toy.restarts == 1 and toy.loads == 2
        finally:
            await toy.close()

    run(main())


def test_abort_stops_within_one_chunk() -> None:
    async def main() -> None:
        toy = Toy(ToyOptions(interval_s=0.02, n=100), "toy")
        await toy.start()
        try:
            got: list[StageOutput] = []
            async for out in toy.submit(llm("long")):
                got.append(out)
                if len(got) == 3:
                    await toy.abort(["long"])
            texts = [o for o in got if isinstance(o, TextOut)]
            assert len(texts) == 3
            assert isinstance(got[-1], StageDone) and got[-1].finish_reason == "aborted"
        finally:
            await toy.close()

    run(main())


def test_realtime_requests_run_before_queued_batch_requests() -> None:
    async def main() -> None:
        toy = Toy(ToyOptions(n=1), "toy")
        await toy.start()
        try:
            toy.gate.clear()
            first = asyncio.create_task(drain(toy, llm("busy")))
            await asyncio.sleep(0.05)  # the worker now blocks on the gate with "busy"
            batch = [
                asyncio.create_task(drain(toy, llm(f"b{i}", priority=Priority.BATCH)))
                for i in range(3)
            ]
            await asyncio.sleep(0.01)
            rt = asyncio.create_task(drain(toy, llm("rt")))
            await asyncio.sleep(0.01)
            toy.gate.set()
            await asyncio.gather(first, rt, *batch)
            assert toy.order == ["busy", "rt", "b0", "b1", "b2"]
        finally:
            await toy.close()

    run(main())


def test_pool_sticky_sessions_and_round_robin_batch() -> None:
    async def main() -> None:
        replicas = [Toy(ToyOptions(n=1), f"toy{i}") for i in range(3)]
        pool = StagePool("toy", replicas)
        await pool.start()
        try:
            for i in range(4):
                await drain(pool, llm(f"s/{i}", session="s"))
            idx = pool.replica_of("s")
            assert idx is not None
            assert len(replicas[idx].order) == 4
            for i in range(6):
                await drain(pool, llm(f"batch{i}", priority=Priority.BATCH))
            assert sorted(len(r.order) for r in replicas) == [2, 2, 6]
            pool.release_session("s")
            assert pool.replica_of("s") is None
        finally:
            await pool.close()

    run(main())


def test_pool_sends_no_new_work_to_a_replica_that_is_down() -> None:
    """Health-aware choice (issue 38): a session sticky to a replica that goes down moves
    to the least loaded live one and stays there; batch work skips it; with every replica
    down the work goes where it would have gone (and fails there with its own error)."""

    async def main() -> None:
        opts = TestStageOptions(role="llm", reply="a b")
        replicas = [TestStage(opts, f"llm{i}") for i in range(3)]
        pool = StagePool("llm", replicas)
        await pool.start()
        try:
            await drain(pool, llm("s/0", session="s"))
            first = pool.replica_of("s")
            assert first is not None
            replicas[first].down = "test: down"
            await drain(pool, llm("s/1", session="s"))
            moved = pool.replica_of("s")
            assert moved is not None and moved != first
            replicas[first].down = None  # back up: the session stays where it went
            await drain(pool, llm("s/2", session="s"))
            assert pool.replica_of("s") == moved
            assert [r.submitted for r in replicas][moved] == ["s/1", "s/2"]
            replicas[1].down = "test: down"
            for i in range(4):
                await drain(pool, llm(f"batch/{i}", priority=Priority.BATCH))
            assert not [r for r in replicas[1].submitted if r.startswith("batch/")]
            assert (
                sum(len([r for r in x.submitted if r.startswith("batch/")]) for x in replicas) == 4
            )
            assert pool.live() == [0, 2]
            for r in replicas:
                r.down = "test: all down"
            assert pool.live() == []
            await drain(pool, llm("s/3", session="s"))  # still served somewhere
            assert pool.replica_of("s") == moved
        finally:
            await pool.close()

    run(main())
