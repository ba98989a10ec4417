"""Batch jobs (speech, chat, transcription) on the same pipeline, at batch priority, and
the table of those running (:class:`BatchJobs`).

Each job takes its route: transcription -> ``transcribe``, speech -> ``speech``, chat ->
the route it names, else ``voice`` when audio is asked for, else ``text``
(engine/pipeline/graph.py). A chat job with tools streams a function call as
:class:`~duplex_contract.batch.CallOut` pieces, never as text.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from duplex_contract.audio import duration_ms
from duplex_contract.batch import (
    AudioOut,
    BatchDone,
    BatchItem,
    BatchJob,
    CallOut,
    ChatJob,
    SpeechJob,
    TextOut,
    TranscribeJob,
    TranscriptOut,
)
from duplex_contract.errors import EngineError
from duplex_contract.session_events import ErrorInfo
from engine.messages import BatchOutput, GenerateRequest, Priority
from engine.pipeline.pipeline import Pipeline, SpokenChunk

log = logging.getLogger(__name__)


def _audio(rid: str, chunk: SpokenChunk) -> AudioOut:
    out = chunk.out
    return AudioOut(
        request_id=rid, pcm=out.pcm, sample_rate=out.sample_rate, t_ns=out.t_ns, text=chunk.mark
    )


async def run_batch(
    pipeline: Pipeline, rid: str, job: BatchJob, put: Callable[[BatchItem], None]
) -> None:
    prefix = f"batch/{rid}"
    if isinstance(job, TranscribeJob):
        text = await pipeline.transcribe(
            f"{prefix}/asr",
            job.audio,
            route="transcribe",
            sample_rate=job.sample_rate,
            session_id=None,
            priority=Priority.BATCH,
            language=job.language,
            hums=job.hums,
        )
        put(TranscriptOut(request_id=rid, text=text, final=True))
        put(BatchDone(request_id=rid, audio_ms=duration_ms(len(job.audio), job.sample_rate)))
    elif isinstance(job, SpeechJob):
        audio_ms = await pipeline.speak(
            prefix,
            job.text,
            route="speech",
            voice=job.voice,
            speed=job.speed,
            sample_rate=job.sample_rate,
            session_id=None,
            priority=Priority.BATCH,
            on_chunk=lambda c: put(_audio(rid, c)),
        )
        put(BatchDone(request_id=rid, audio_ms=audio_ms))
    else:
        assert isinstance(job, ChatJob)
        result = await pipeline.respond(
            prefix,
            job.messages,
            route=job.route or ("voice" if job.audio else "text"),
            max_tokens=job.max_tokens,
            temperature=job.temperature,
            voice=job.voice,
            sample_rate=job.sample_rate,
            session_id=None,
            priority=Priority.BATCH,
            on_text=lambda t: put(TextOut(request_id=rid, text=t)),
            on_chunk=lambda c: put(_audio(rid, c)),
            tools=job.tools,
            tool_required=job.tool_required,
            on_call=lambda t: put(CallOut(request_id=rid, text=t)),
        )
        put(
            BatchDone(
                request_id=rid,
                prompt_tokens=result.prompt_tokens,
                completion_tokens=result.tokens,
                audio_ms=result.audio_ms,
                finish_reason="tool_calls" if result.call else result.finish_reason,
            )
        )


async def serve_batch(
    pipeline: Pipeline,
    msg: GenerateRequest,
    put: Callable[[BatchOutput], None],
    abort: Callable[[str], Awaitable[None]],
) -> None:
    """Run one batch request to its end, every outcome put as a :class:`BatchOutput`: its
    items, or one error (``aborted`` when the task is cancelled, after ``abort(prefix)``
    stopped its stage requests)."""
    rid = msg.request_id

    def item(value: BatchItem) -> None:
        put(BatchOutput(request_id=rid, item=value))

    def error(code: str, message: str) -> None:
        info = ErrorInfo(kind="stage", code=code, message=message, request_id=rid)
        put(BatchOutput(request_id=rid, error=info))

    try:
        await run_batch(pipeline, rid, msg.job, item)
    except asyncio.CancelledError:
        await abort(f"batch/{rid}/")
        error("aborted", "request aborted")
    except EngineError as exc:
        put(BatchOutput(request_id=rid, error=ErrorInfo.from_exc(exc, request_id=rid)))
    except Exception as exc:
        log.exception("batch request %s failed", rid)
        error("stage_failed", repr(exc))


class BatchJobs:
    """The batch requests running on the orchestrator's loop, by request id: each in a
    task of its own (``serve_batch``) that an ``AbortRequest`` cancels. ``put`` takes their
    outputs, ``abort(prefix)`` stops a cancelled one's stage requests."""

    def __init__(
        self,
        pipeline: Pipeline,
        put: Callable[[BatchOutput], None],
        abort: Callable[[str], Awaitable[None]],
    ) -> None:
        self._pipeline = pipeline
        self._put = put
        self._abort = abort
        self._running: dict[str, asyncio.Task[None]] = {}

    def start(self, msg: GenerateRequest) -> None:
        task = asyncio.create_task(self._run(msg), name=f"batch:{msg.request_id}")
        self._running[msg.request_id] = task

    def cancel(self, request_id: str) -> None:
        running = self._running.get(request_id)
        if running is not None:
            running.cancel()

    def tasks(self) -> list[asyncio.Task[None]]:
        return list(self._running.values())

    async def _run(self, msg: GenerateRequest) -> None:
        try:
            await serve_batch(self._pipeline, msg, self._put, self._abort)
        finally:
            self._running.pop(msg.request_id, None)
