"""Runs work along a route of the stage graph, streaming between stages.

A route (engine/pipeline/graph.py) is input stages (audio -> text), an optional responder
(text -> text, the LLM) and output stages (text -> ... -> audio). The pipeline knows stages only by
their edge types, never by name:

* :meth:`Pipeline.transcribe` runs a route's input stages on one utterance;
* :meth:`Pipeline.respond` runs the responder on a conversation and streams its text into
  the output stages;
* :meth:`Pipeline.speak` streams text straight into the output stages.

The output stages run as a chain of tasks, one per stage: each consumes its input in order,
one request per chunk (a segment of text, a window of codec frames; see
engine/pipeline/chunkers.py),
and its outputs are cut into the next stage's chunks as they arrive. So the first audio does
not wait for the whole reply, and every stage works on the next chunk while the stage after
it handles the previous one.

Every stage request id embeds the fence (``sess_x/e3/t5/r1/llm``, ``.../tts0``), so a
cancel aborts exactly one epoch's work in every stage; outputs reach the orchestrator through
the ``on_text``/``on_chunk`` callbacks, which drop anything whose fence is stale.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from duplex_contract.audio import duration_ms
from duplex_contract.batch import AudioOut, ChatMessage, TextOut, TranscriptOut
from duplex_contract.errors import StageError
from duplex_contract.settings import Tool
from engine.config import EngineConfig
from engine.messages import (
    AsrRequest,
    LlmRequest,
    Priority,
    StageDone,
    StageOutput,
    StageRequest,
    TokensRequest,
    TtsRequest,
)
from engine.pipeline.chunkers import Chunk, Chunker, default_chunker
from engine.pipeline.graph import Graph, Route, StageInfo
from engine.pipeline.segmenter import SentenceStop
from engine.pipeline.stage_slots import Slots, Urgency, urgency_of
from engine.stages.base import ChunkerSource
from engine.stages.edges import Edge
from engine.stages.pool import StagePool

__all__ = ["LlmResult", "Pipeline", "SpokenChunk"]


@dataclass(frozen=True)
class SpokenChunk:
    out: AudioOut
    audio_start_ms: float
    duration_ms: float
    mark: str


@dataclass
class LlmResult:
    text: str = ""
    tokens: int = 0
    prompt_tokens: int = 0
    finish_reason: str = "stop"
    audio_ms: float = 0.0
    call: bool = False  # ``text`` is a function call


@dataclass(frozen=True)
class Voice:
    """How output stages should sound: passed into every request they get."""

    voice: str | None = None
    speed: float = 1.0
    sample_rate: int = 24000


_END = None


async def _drained(q: asyncio.Queue[Any]) -> AsyncIterator[StageOutput]:
    """The outputs a request's pump put in ``q``, to its end (an error it met is raised)."""
    while (item := await q.get()) is not _END:
        if isinstance(item, Exception):
            raise item
        yield item


#: Later segments a batching output stage (the talker) starts while it samples this one. Off:
#: one started ahead ran to its end before a barge-in could abort it (docs/gpu.md).
SEGMENTS_AHEAD = 0


class Pipeline:
    def __init__(
        self,
        config: EngineConfig,
        graph: Graph,
        pools: dict[str, StagePool],
        slots: Slots,
    ) -> None:
        self.config = config
        self.graph = graph
        self.pools = pools
        self.slots = slots  # when work may use the stages beside real-time turns

    def route(self, name: str) -> Route:
        return self.graph.route(name)

    def _chunker(self, stage: StageInfo, *, early_first: bool = True) -> Chunker:
        replica = self.pools[stage.name].replicas[0]
        chunker = replica.make_chunker() if isinstance(replica, ChunkerSource) else None
        segmenter = self.config.segmenter
        return chunker or default_chunker(stage.consumes, segmenter, early_first=early_first)

    async def _run(self, stage: StageInfo, req: StageRequest) -> AsyncGenerator[StageOutput, None]:
        async with self.slots.slot(stage.name, req) as ticket:
            async for out in self.pools[stage.name].submit(req):
                ticket.output(not isinstance(out, StageDone))
                yield out

    # ------------------------------------------------------------------ input stages
    async def transcribe(
        self,
        request_id: str,
        audio: bytes,
        *,
        route: str = "transcribe",
        sample_rate: int,
        session_id: str | None,
        priority: Priority = Priority.REALTIME,
        language: str = "en",
        context: tuple[bytes, str] | None = None,
        context_gap_s: float = 0.0,
        hums: bool = False,
    ) -> str:
        """Run ``route``'s input stages on one utterance; returns its text. ``context``: the
        previous turn's audio (same rate) and transcript, for the first stage, which ended
        ``context_gap_s`` before this utterance began (``hums``: ``AsrRequest.hums``)."""
        stages = self.route(route).inputs
        if not stages:
            raise StageError(f"route {route!r} has no input stages", code="route_unavailable")
        rate = sample_rate
        text = ""
        for i, stage in enumerate(stages):
            rid = request_id if i == 0 else f"{request_id}/{stage.name}"
            req = AsrRequest(
                request_id=rid,
                audio=audio,
                sample_rate=rate,
                language=language,
                priority=priority,
                session_id=session_id,
                context_audio=context[0] if context and i == 0 else b"",
                context_text=context[1] if context and i == 0 else "",
                context_gap_s=context_gap_s,
                hums=hums and i == 0,
            )
            pcm: list[bytes] = []
            parts: list[str] = []
            async for out in self._run(stage, req):
                if isinstance(out, TranscriptOut) and out.final:
                    parts = [out.text]
                elif isinstance(out, TextOut):
                    parts.append(out.text)
                elif isinstance(out, AudioOut):
                    pcm.append(out.pcm)
                    rate = out.sample_rate
                elif isinstance(out, StageDone) and out.finish_reason == "aborted":
                    raise StageError("aborted", code="aborted")
            if stage.emits is Edge.AUDIO:
                audio = b"".join(pcm)
            text = "".join(parts)
        return text.strip()

    # ------------------------------------------------------------------ output stages
    def _request(
        self,
        stage: StageInfo,
        rid: str,
        chunk: Chunk,
        voice: Voice,
        meta: tuple[Urgency, str | None],
        first: bool = False,
    ) -> StageRequest:
        urgency, session_id = meta
        priority = urgency()
        if stage.consumes is Edge.TEXT:
            return TtsRequest(
                request_id=rid,
                text=chunk.text,
                voice=voice.voice,
                speed=voice.speed,
                sample_rate=voice.sample_rate,
                priority=priority,
                session_id=session_id,
                first=first,
            )
        return TokensRequest(
            request_id=rid,
            ids=chunk.ids,
            context=chunk.context,
            final=chunk.final,
            sample_rate=voice.sample_rate,
            voice=voice.voice,
            priority=priority,
            session_id=session_id,
        )

    async def _output_chain(
        self,
        prefix: str,
        stages: Sequence[StageInfo],
        first: asyncio.Queue[tuple[Chunk, str] | None],
        voice: Voice,
        meta: tuple[Urgency, str | None],
        on_chunk: Callable[[SpokenChunk], None],
        on_text: Callable[[str], None] | None = None,
    ) -> float:
        """Run the output stages as a chain of tasks; returns the audio produced (ms)."""
        cursor = 0.0
        queues: list[asyncio.Queue[tuple[Chunk, str] | None]] = [first] + [
            asyncio.Queue() for _ in stages[1:]
        ]

        async def stage_task(i: int) -> None:
            nonlocal cursor
            stage, inq = stages[i], queues[i]
            last = i == len(stages) - 1
            outq = None if last else queues[i + 1]
            n = 0

            def make(chunk: Chunk) -> StageRequest:
                nonlocal n
                rid = f"{prefix}/{stage.name}{n}"
                req = self._request(stage, rid, chunk, voice, meta, first=i == n == 0)
                n += 1
                return req

            cap = self.slots.capacity_of(stage.name)
            ahead = SEGMENTS_AHEAD if outq is not None and cap > 1 else 0
            try:
                async with contextlib.aclosing(self._in_order(stage, inq, make, ahead)) as each:
                    async for mark, outs in each:
                        chunker = None if outq is None else self._chunker(stages[i + 1])
                        pending_mark = mark
                        async for out in outs:
                            if isinstance(out, StageDone):
                                if out.finish_reason == "aborted":
                                    raise StageError("aborted", code="aborted")
                                continue
                            if outq is not None and chunker is not None:
                                for c in chunker.push(out):
                                    outq.put_nowait((c, pending_mark))
                                    pending_mark = ""
                            elif isinstance(out, AudioOut) and out.pcm:
                                dur = duration_ms(len(out.pcm), out.sample_rate)
                                spoken = out.text or pending_mark
                                pending_mark = ""
                                on_chunk(SpokenChunk(out, cursor, dur, spoken))
                                cursor += dur
                            elif isinstance(out, TextOut) and on_text is not None:
                                on_text(out.text)
                        if outq is not None and chunker is not None:
                            for c in chunker.flush():
                                outq.put_nowait((c, pending_mark))
                                pending_mark = ""
            finally:
                if outq is not None:
                    outq.put_nowait(_END)

        tasks = [
            asyncio.create_task(stage_task(i), name=f"{stages[i].name}:{prefix}")
            for i in range(len(stages))
        ]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                if not t.done():
                    t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return cursor

    async def _in_order(
        self,
        stage: StageInfo,
        inq: asyncio.Queue[tuple[Chunk, str] | None],
        make: Callable[[Chunk], StageRequest],
        ahead: int,
    ) -> AsyncGenerator[tuple[str, AsyncIterator[StageOutput]], None]:
        """One ``(mark, outputs)`` per input chunk, in order. ``ahead``: how many later
        chunks' requests run meanwhile (a talker starts the next segment while it still
        samples this one: the next one's first frames are ready when this one ends, instead
        of a gap of its prefill and first window). Their outputs wait their turn."""
        if ahead == 0:
            while (item := await inq.get()) is not _END:
                yield item[1], self._run(stage, make(item[0]))
            return
        order: asyncio.Queue[tuple[str, asyncio.Queue[Any]] | None] = asyncio.Queue()
        room = asyncio.Semaphore(1 + ahead)
        pumps: set[asyncio.Task[None]] = set()

        async def pump(req: StageRequest, q: asyncio.Queue[Any]) -> None:
            try:
                async for out in self._run(stage, req):
                    q.put_nowait(out)
                q.put_nowait(_END)
            except Exception as exc:  # its turn raises it
                q.put_nowait(exc)
            finally:
                room.release()

        async def start() -> None:
            try:
                while (item := await inq.get()) is not _END:
                    await room.acquire()
                    q: asyncio.Queue[Any] = asyncio.Queue()
                    task = asyncio.create_task(pump(make(item[0]), q), name=f"{stage.name}:ahead")
                    pumps.add(task)
                    task.add_done_callback(pumps.discard)
                    order.put_nowait((item[1], q))
            finally:
                order.put_nowait(None)

        starter = asyncio.create_task(start(), name=f"{stage.name}:start")
        try:
            while (entry := await order.get()) is not None:
                yield entry[0], _drained(entry[1])
            await starter
        finally:
            for task in (starter, *pumps):
                task.cancel()
            await asyncio.gather(starter, *pumps, return_exceptions=True)

    async def speak(
        self,
        prefix: str,
        text: str,
        *,
        route: str = "speech",
        voice: str | None,
        speed: float,
        sample_rate: int,
        session_id: str | None,
        priority: Priority | Urgency,
        on_chunk: Callable[[SpokenChunk], None],
    ) -> float:
        """Speak ``text`` along ``route``'s output stages; returns the audio duration (ms)."""
        r = self.route(route)
        stages = r.outputs
        if r.responder is not None or not stages or stages[0].consumes is not Edge.TEXT:
            raise StageError(f"route {route!r} cannot speak text", code="route_unavailable")
        first: asyncio.Queue[tuple[Chunk, str] | None] = asyncio.Queue()
        chunker = self._chunker(stages[0], early_first=False)  # whole sentences: no pause
        for c in [*chunker.push(TextOut(request_id=prefix, text=text)), *chunker.flush()]:
            first.put_nowait((c, c.text))
        first.put_nowait(_END)
        return await self._output_chain(
            prefix,
            stages,
            first,
            Voice(voice, speed, sample_rate),
            (urgency_of(priority), session_id),
            on_chunk,
        )

    # ------------------------------------------------------------------ responder
    async def respond(
        self,
        prefix: str,
        messages: tuple[ChatMessage, ...],
        *,
        route: str,
        max_tokens: int,
        temperature: float,
        voice: str | None,
        sample_rate: int,
        session_id: str | None,
        priority: Priority | Urgency,
        on_text: Callable[[str], None],
        on_chunk: Callable[[SpokenChunk], None],
        tools: tuple[Tool, ...] = (),
        tool_required: bool = False,
        on_call: Callable[[str], None] | None = None,
        max_sentences: int | None = None,
        max_words: int | None = None,
    ) -> LlmResult:
        """Stream the responder's text to ``on_text`` and through the output stages. With
        ``tools``, an output that opens with ``{`` (always, under ``tool_required``) is a
        function call: its text goes to ``on_call`` only (``LlmResult.call``), never to the
        output stages. ``max_sentences``: the text ends after that many sentences, or after the
        first that ends past ``max_words`` words (the LLM request is stopped there: ``stop``)."""
        r = self.route(route)
        if r.responder is None:
            raise StageError(f"route {route!r} has no responder", code="route_unavailable")
        result = LlmResult()
        urgency = urgency_of(priority)
        outputs = r.outputs
        first: asyncio.Queue[tuple[Chunk, str] | None] = asyncio.Queue()
        chunker = self._chunker(outputs[0]) if outputs else None
        chain: asyncio.Task[float] | None = None
        if outputs:
            chain = asyncio.create_task(
                self._output_chain(
                    prefix,
                    outputs,
                    first,
                    Voice(voice, 1.0, sample_rate),
                    (urgency, session_id),
                    on_chunk,
                ),
                name=f"outputs:{prefix}",
            )
        parts: list[str] = []
        req = LlmRequest(
            request_id=f"{prefix}/{r.responder.name}",
            messages=messages,
            max_tokens=max_tokens,
            temperature=temperature,
            priority=urgency(),
            session_id=session_id,
            tools=tools,
            tool_required=tool_required,
        )

        def feed(chunks: list[Chunk]) -> None:
            for c in chunks:
                first.put_nowait((c, c.text))

        # None: not known yet whether the output is a call (the first non-space decides)
        calling: bool | None = None if tools else False
        held = ""
        stop = SentenceStop(max_sentences, max_words) if max_sentences is not None else None
        pieces = 0
        cut = False  # the spoken reply's sentences are all out: the request was stopped
        try:
            async with contextlib.aclosing(self._run(r.responder, req)) as outs:
                async for out in outs:
                    if cut and not isinstance(out, StageDone):
                        continue
                    if isinstance(out, TextOut):
                        pieces += 1
                    if isinstance(out, TextOut) and calling is None:
                        held += out.text
                        if not held.strip():
                            continue
                        calling = tool_required or held.lstrip().startswith("{")
                        out = TextOut(request_id=out.request_id, text=held)
                    if isinstance(out, TextOut) and calling:
                        parts.append(out.text)
                        if on_call is not None:
                            on_call(out.text)
                    elif isinstance(out, TextOut):
                        if stop is not None:
                            out = TextOut(request_id=out.request_id, text=stop.push(out.text))
                        if out.text:
                            parts.append(out.text)
                            on_text(out.text)
                            if chunker is not None:
                                feed(chunker.push(out))
                        if stop is not None and stop.stopped:
                            # stop the request, and wait for its end: it says the prompt's
                            # length (usage); a backend that ends without it leaves 0
                            cut = True
                            result.tokens, result.finish_reason = pieces, "stop"
                            await self.pools[r.responder.name].abort([req.request_id])
                    elif isinstance(out, StageDone):
                        result.prompt_tokens = out.prompt_tokens
                        if not cut:
                            result.tokens = out.tokens
                            result.finish_reason = out.finish_reason
            done = stop is not None and result.finish_reason != "aborted"
            tail = stop.flush() if stop is not None and done else ""  # a held last sentence
            if tail:
                parts.append(tail)
                on_text(tail)
                if chunker is not None:
                    feed(chunker.push(TextOut(request_id=req.request_id, text=tail)))
            if chunker is not None:
                feed(chunker.flush())
            first.put_nowait(_END)
            result.text = "".join(parts)
            result.call = bool(calling)
            if chain is not None:
                result.audio_ms = await chain
        finally:
            if chain is not None and not chain.done():
                chain.cancel()
                await asyncio.gather(chain, return_exceptions=True)
        if result.finish_reason == "aborted":
            raise StageError("aborted", code="aborted")
        return result
