"""engine/stages/compute.py: which stage replicas compute now, as the stage runtimes mark
it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from duplex_contract.batch import TextOut
from engine.messages import StageDone, StageOutput, StageRequest
from engine.stages import compute
from engine.stages.batching import BatchingRuntime, BatchSlot
from engine.stages.threaded import ThreadedRuntime


def test_working_counts_nested_units_and_others_busy_excludes_itself() -> None:
    assert compute.busy() == {}
    with compute.working("asr"):
        assert compute.busy() == {"asr": 1}
        assert not compute.others_busy("asr") and compute.others_busy("llm")
        with compute.working("asr"), compute.working("tts"):
            assert compute.busy() == {"asr": 2, "tts": 1}
            assert compute.others_busy("asr")
        assert compute.busy() == {"asr": 1}
    assert compute.busy() == {} and not compute.others_busy("llm")


def test_wait_urgent_blocks_while_its_group_has_urgent_work() -> None:
    """A decoder pauses while its own response's first clause is spoken: only for its own
    group, at most ``limit_s``, and not past a cancel."""
    assert compute.group_of("sess_a/e0/draft3/tts0") == "sess_a/e0/draft3"
    assert compute.wait_urgent("g", None, 1.0) == 0.0  # nothing urgent: no wait
    done = threading.Event()

    def hold(seconds: float) -> None:
        with compute.urgent("g"):
            done.wait(seconds)

    t = threading.Thread(target=hold, args=(0.3,))
    t.start()
    while "g" not in compute.urgent_groups():
        pass
    assert compute.wait_urgent("other", None, 1.0) == 0.0  # another response's: no wait
    waited = compute.wait_urgent("g", None, 5.0)
    assert 0.2 < waited < 2.0 and compute.urgent_groups() == {}
    t.join()
    # the limit and a cancel each end the wait while the work goes on
    t = threading.Thread(target=hold, args=(5.0,))
    t.start()
    while "g" not in compute.urgent_groups():
        pass
    assert compute.wait_urgent("g", None, 0.1) < 1.0
    cancelled = threading.Event()
    threading.Timer(0.1, cancelled.set).start()
    assert compute.wait_urgent("g", cancelled, 5.0) < 1.0
    done.set()
    t.join()
    assert compute.urgent_groups() == {}


class _Threaded:
    """A one-request-at-a-time text model that records what compute says while it runs."""

    def __init__(self) -> None:
        self.seen: list[dict[str, int]] = []
        self.urgent: list[dict[str, int]] = []

    def load(self) -> None:
        pass

    def unload(self) -> None:
        pass

    def run(self, request: StageRequest, cancelled: threading.Event) -> Iterator[StageOutput]:
        self.seen.append(compute.busy())
        self.urgent.append(compute.urgent_groups())
        yield TextOut(request_id=request.request_id, text="x")
        yield StageDone(request_id=request.request_id, finish_reason="stop")


class _Batching:
    """A batching text model that records what compute says while a step runs."""

    def __init__(self) -> None:
        self.seen: list[dict[str, int]] = []

    def load(self) -> None:
        pass

    def unload(self) -> None:
        pass

    def prepare(self, request: StageRequest) -> Any:
        return None

    def step(self, batch: Sequence[BatchSlot]) -> None:
        self.seen.append(compute.busy())
        for slot in batch:
            slot.emit(StageDone(request_id=slot.request.request_id, finish_reason="stop"))
            slot.finish()


def test_the_stage_runtimes_mark_their_work() -> None:
    async def main() -> None:
        from engine.messages import LlmRequest

        threaded, batching = _Threaded(), _Batching()
        runtimes: list[tuple[Any, ThreadedRuntime | BatchingRuntime]] = [
            (threaded, ThreadedRuntime("threaded-x", threaded)),
            (batching, BatchingRuntime("batching-x", batching, max_batch=8)),
        ]
        for model, runtime in runtimes:
            await runtime.start()
            try:
                req = LlmRequest(request_id="r", messages=())
                outs = [o async for o in runtime.submit(req)]
                assert isinstance(outs[-1], StageDone)
                assert model.seen == [{runtime.name: 1}]
                assert compute.busy() == {}  # released when the work ends
            finally:
                await runtime.close()

    asyncio.run(main())


def test_the_threaded_runtime_marks_a_first_clause_urgent() -> None:
    """A response's first clause (``TtsRequest.first``) is urgent work of its response's
    group while it runs; later clauses are not."""

    async def main() -> None:
        from engine.messages import TtsRequest

        model = _Threaded()
        runtime = ThreadedRuntime("threaded-x", model)
        await runtime.start()
        try:
            for rid, first in (("sess_a/e0/t1/r1/tts0", True), ("sess_a/e0/t1/r1/tts1", False)):
                outs = [o async for o in runtime.submit(TtsRequest(rid, "x", first=first))]
                assert isinstance(outs[-1], StageDone)
            assert model.urgent == [{"sess_a/e0/t1/r1": 1}, {}]
            assert compute.urgent_groups() == {}
        finally:
            await runtime.close()

    asyncio.run(main())
