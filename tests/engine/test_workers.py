"""The worker runtimes' parts alone: Job, Worker (with a scripted job loop), BatchSlot, and
the hooks and figures the two runtimes (engine/stages/threaded.py, batching.py) report."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from duplex_contract.batch import TextOut
from duplex_contract.errors import StageError
from engine.messages import LlmRequest, StageDone, StageOutput, StageRequest
from engine.stages.batching import BatchingRuntime, BatchSlot
from engine.stages.threaded import ThreadedRuntime
from engine.stages.workers import Job, Worker, WorkerCrash
from tests.engine.conftest import UNIT, run


def req(rid: str) -> LlmRequest:
    return LlmRequest(request_id=rid, messages=())


async def drain(stage: Any, request: StageRequest) -> list[StageOutput]:
    return [out async for out in stage.submit(request)]


# ----------------------------------------------------------------------------- Job
def test_a_job_ends_fails_or_aborts_its_stream_and_reports_its_wait() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        waits: list[float] = []
        job = Job(request=req("r"), loop=loop, out=asyncio.Queue(), on_wait=waits.append)
        job.started()
        assert len(waits) == 1 and 0 <= waits[0] < 5 * UNIT
        job.deliver(TextOut(request_id="r", text="a"))
        job.end_aborted()
        await asyncio.sleep(0)
        got = [job.out.get_nowait() for _ in range(job.out.qsize())]
        assert got[0] == TextOut(request_id="r", text="a")
        assert got[1] == StageDone(request_id="r", finish_reason="aborted")
        assert len(got) == 3  # and the end of the stream
        failing = Job(request=req("f"), loop=loop, out=asyncio.Queue())
        failing.started()  # no hook: nothing to report
        failing.fail(StageError("boom"))
        await asyncio.sleep(0)
        assert isinstance(failing.out.get_nowait(), StageError)
        assert failing.out.qsize() == 1  # the end of the stream

    run(main())


def test_a_job_whose_loop_is_closed_counts_as_cancelled() -> None:
    loop = asyncio.new_event_loop()
    job = Job(request=req("r"), loop=loop, out=asyncio.Queue())
    loop.close()
    job.deliver(TextOut(request_id="r", text="late"))
    assert job.cancelled.is_set()


# ----------------------------------------------------------------------------- Worker
class _Model:
    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.loads = 0
        self.unloads = 0

    def load(self) -> None:
        self.loads += 1
        if self.fail:
            raise RuntimeError("no weights")

    def unload(self) -> None:
        self.unloads += 1


class _Loop:
    """A job loop driven by the test: ``serve`` answers each job (or crashes the worker)."""

    def __init__(self) -> None:
        self.jobs: list[Job] = []
        self.crash = threading.Event()
        self.stopped = threading.Event()
        self._held: list[Job] = []
        self._new = threading.Condition()

    def enqueue(self, job: Job) -> None:
        with self._new:
            self.jobs.append(job)
            self._new.notify()

    def serve(self) -> None:
        while True:
            with self._new:
                while not self.jobs and not self.stopped.is_set():
                    self._new.wait(0.01)
                if self.stopped.is_set():
                    return
                job = self.jobs.pop(0)
            if self.crash.is_set():
                self.crash.clear()
                self._held = [job]
                raise WorkerCrash("gone")
            job.batch_max = 1
            job.deliver(TextOut(request_id=job.request.request_id, text="ok"))
            job.end()

    def stop(self) -> None:
        self.stopped.set()

    def dead_jobs(self) -> list[Job]:
        dead, self._held = self._held, []
        return dead


def test_a_worker_loads_serves_restarts_after_a_crash_and_unloads_at_close() -> None:
    async def main() -> None:
        model, loop = _Model(), _Loop()
        worker = Worker("w", model, loop)
        await worker.start()
        assert worker.alive and model.loads == 1
        assert [type(o) for o in await drain(worker, req("a"))] == [TextOut]
        loop.crash.set()
        with pytest.raises(StageError) as info:
            await drain(worker, req("b"))
        assert info.value.code == "worker_died"
        for _ in range(200):
            if worker.restarts == 1 and worker.alive:
                break
            await asyncio.sleep(0.01)
        assert worker.restarts == 1 and model.loads == 2  # a new thread, the model again
        assert await drain(worker, req("c")) == [TextOut(request_id="c", text="ok")]
        assert worker.batch_size("c") == 0  # gone once its stream ended
        await worker.close()
        assert not worker.alive and model.unloads == 1
        with pytest.raises(StageError, match="closed"):
            await drain(worker, req("d"))

    run(main())


def test_a_model_that_fails_to_load_fails_start() -> None:
    async def main() -> None:
        worker = Worker("w", _Model(fail=True), _Loop())
        with pytest.raises(StageError, match="w: load failed: no weights"):
            await worker.start()
        assert not worker.alive

    run(main())


# ----------------------------------------------------------------------------- BatchSlot
def test_a_batch_slot_keeps_one_steps_outputs_until_cleared() -> None:
    async def main() -> None:
        job = Job(request=req("r"), loop=asyncio.get_running_loop(), out=asyncio.Queue())
        slot = BatchSlot(job, seq=3, state=["x"])
        assert (slot.request, slot.seq, slot.state, slot.steps) == (job.request, 3, ["x"], 0)
        slot.emit(TextOut(request_id="r", text="a"))
        slot.finish()
        assert slot.outputs == [TextOut(request_id="r", text="a")] and slot.done
        slot.clear()
        assert slot.outputs == [] and not slot.done and slot.failure is None
        error = ValueError("bad")
        slot.fail(error)
        assert slot.failure is error and slot.done
        assert not slot.cancelled
        job.cancelled.set()
        assert slot.cancelled

    run(main())


# ----------------------------------------------------------------------------- the runtimes
class _OneAtATime:
    def load(self) -> None:
        pass

    def unload(self) -> None:
        pass

    def run(self, request: StageRequest, cancelled: threading.Event) -> Iterator[StageOutput]:
        yield StageDone(request_id=request.request_id)


class _Steps:
    def load(self) -> None:
        pass

    def unload(self) -> None:
        pass

    def prepare(self, request: StageRequest) -> Any:
        return 2  # steps to take

    def step(self, batch: Sequence[BatchSlot]) -> None:
        for slot in batch:
            slot.state -= 1
            if slot.state == 0:
                slot.emit(StageDone(request_id=slot.request.request_id))
                slot.finish()


def test_the_runtimes_report_waits_steps_and_batch_sizes() -> None:
    async def main() -> None:
        waits: list[float] = []
        threaded = ThreadedRuntime("t", _OneAtATime())
        threaded.on_wait = waits.append
        assert threaded.on_wait == waits.append
        await threaded.start()
        try:
            await drain(threaded, req("a"))
            assert len(waits) == 1 and threaded.restarts == 0
        finally:
            await threaded.close()

        sizes: list[int] = []
        batching = BatchingRuntime("b", _Steps(), max_batch=4)
        batching.on_step, batching.on_wait = sizes.append, waits.append
        assert batching.capacity == 4
        await batching.start()
        try:
            seen: list[int] = []

            async def one(rid: str) -> None:
                async for _ in batching.submit(req(rid)):
                    seen.append(batching.batch_size(rid))

            await asyncio.gather(*(one(f"r{i}") for i in range(3)))
            assert batching.steps == len(sizes) and sum(sizes) == batching.items_stepped == 6
            assert batching.max_step_size == max(sizes) and len(waits) == 1 + 3
            assert seen and all(1 <= s <= 3 for s in seen)
        finally:
            await batching.close()

    run(main())
