"""BatchJobs (engine/orchestration/batch_jobs.py): each batch request runs in a task of its
own until it ends; an abort cancels it, stops its stage requests and answers ``aborted``."""

from __future__ import annotations

import asyncio
from typing import Any

from duplex_contract.batch import BatchDone, TranscribeJob, TranscriptOut
from engine.messages import BatchOutput, GenerateRequest
from engine.orchestration.batch_jobs import BatchJobs
from tests.engine.conftest import run
from tests.engine.parts_fakes import settle


class Pipeline:
    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.asked: list[dict[str, Any]] = []

    async def transcribe(self, prefix: str, audio: bytes, **kw: Any) -> str:
        self.asked.append(kw)
        await self.gate.wait()
        return "hello"


def _jobs() -> tuple[BatchJobs, Pipeline, list[BatchOutput], list[str]]:
    pipeline, put, aborted = Pipeline(), [], []

    async def abort(prefix: str) -> None:
        aborted.append(prefix)

    return BatchJobs(pipeline, put.append, abort), pipeline, put, aborted  # type: ignore[arg-type]


def test_a_batch_request_runs_to_its_end() -> None:
    async def main() -> None:
        jobs, pipeline, put, aborted = _jobs()
        jobs.start(GenerateRequest(request_id="r1", job=TranscribeJob(audio=b"\0\0" * 1600)))
        (task,) = jobs.tasks()
        assert task.get_name() == "batch:r1"
        pipeline.gate.set()
        await settle()
        items = [o.item for o in put]
        assert items[0] == TranscriptOut(request_id="r1", text="hello", final=True)
        assert isinstance(items[1], BatchDone) and aborted == [] and jobs.tasks() == []
        assert pipeline.asked[0]["hums"] is False

    run(main())


def test_a_transcription_that_may_be_a_hum_asks_the_asr_for_the_hum_check() -> None:
    """``TranscribeJob.hums`` (the words of a speech over an answer) reaches the pipeline,
    which passes it to the ASR stage (``AsrRequest.hums``)."""

    async def main() -> None:
        jobs, pipeline, _, _ = _jobs()
        job = TranscribeJob(audio=b"\0\0" * 1600, hums=True)
        jobs.start(GenerateRequest(request_id="r1", job=job))
        pipeline.gate.set()
        await settle()
        assert pipeline.asked[0]["hums"] is True

    run(main())


def test_an_abort_cancels_the_request_and_stops_its_stages() -> None:
    async def main() -> None:
        jobs, _, put, aborted = _jobs()
        jobs.start(GenerateRequest(request_id="r1", job=TranscribeJob(audio=b"\0\0" * 1600)))
        await settle()
        jobs.cancel("r1")
        jobs.cancel("unknown")  # already gone: nothing happens
        await settle()
        assert aborted == ["batch/r1/"]
        (out,) = put
        assert out.error is not None and out.error.code == "aborted"
        assert jobs.tasks() == []

    run(main())
