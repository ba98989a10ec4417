"""The cascaded pipeline: ASR -> AR LLM -> segmenter -> TTS, streaming between stages.

TTS starts on the first segment while the LLM is still generating. Every stage request id
embeds the fence (``sess_x/e3/t5/r1/llm``), so a cancel aborts exactly one epoch's work.
Outputs go through an ``emit`` callback that drops anything whose fence is stale.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from engine.admission import BatchAdmission
from engine.config import EngineConfig
from engine.errors import StageError
from engine.messages import (
    AsrRequest,
    AudioOut,
    ChatMessage,
    LlmRequest,
    Priority,
    StageDone,
    TextOut,
    TranscriptOut,
    TtsRequest,
)
from engine.segmenter import Segmenter
from engine.stages.base import StagePool

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


class Pipeline:
    def __init__(
        self,
        config: EngineConfig,
        pools: dict[str, StagePool],
        admission: BatchAdmission | None = None,
    ) -> None:
        self.config = config
        self.admission = admission or BatchAdmission()
        self.asr = pools["asr"]
        self.llm = pools["llm"]
        self.tts = pools["tts"]

    async def transcribe(
        self,
        request_id: str,
        audio: bytes,
        *,
        sample_rate: int,
        session_id: str | None,
        priority: Priority = Priority.REALTIME,
        language: str = "en",
    ) -> str:
        req = AsrRequest(
            request_id=request_id,
            audio=audio,
            sample_rate=sample_rate,
            language=language,
            priority=priority,
            session_id=session_id,
        )
        text = ""
        async with self.admission.slot(priority):
            async for out in self.asr.submit(req):
                if isinstance(out, TranscriptOut) and out.final:
                    text = out.text
        return text.strip()

    async def speak(
        self,
        prefix: str,
        segments: AsyncIterator[str] | list[str],
        *,
        voice: str | None,
        speed: float,
        sample_rate: int,
        session_id: str | None,
        priority: Priority,
        on_chunk: Callable[[SpokenChunk], None],
    ) -> float:
        """Synthesize segments in order; returns the audio duration produced (ms)."""
        cursor = 0.0
        n = 0

        async def each(seg: str) -> None:
            nonlocal cursor, n
            req = TtsRequest(
                request_id=f"{prefix}/tts{n}",
                text=seg,
                voice=voice,
                speed=speed,
                sample_rate=sample_rate,
                priority=priority,
                session_id=session_id,
            )
            n += 1
            first = True
            async with self.admission.slot(priority):
                async for out in self.tts.submit(req):
                    if not isinstance(out, AudioOut) or not out.pcm:
                        continue
                    dur = len(out.pcm) / 2 / out.sample_rate * 1000.0
                    mark = out.text or (seg if first else "")
                    first = False
                    on_chunk(SpokenChunk(out, cursor, dur, mark))
                    cursor += dur

        if isinstance(segments, list):
            for seg in segments:
                await each(seg)
        else:
            async for seg in segments:
                await each(seg)
        return cursor

    async def respond(
        self,
        prefix: str,
        messages: tuple[ChatMessage, ...],
        *,
        max_tokens: int,
        temperature: float,
        want_audio: bool,
        voice: str | None,
        sample_rate: int,
        session_id: str | None,
        priority: Priority,
        on_text: Callable[[str], None],
        on_chunk: Callable[[SpokenChunk], None],
    ) -> LlmResult:
        """Stream LLM text to ``on_text`` and, if wanted, its speech to ``on_chunk``."""
        result = LlmResult()
        segq: asyncio.Queue[str | None] = asyncio.Queue()
        segmenter = Segmenter(self.config.segmenter)

        async def segments() -> AsyncIterator[str]:
            while (seg := await segq.get()) is not None:
                yield seg

        speaker: asyncio.Task[float] | None = None
        if want_audio:
            speaker = asyncio.create_task(
                self.speak(
                    prefix,
                    segments(),
                    voice=voice,
                    speed=1.0,
                    sample_rate=sample_rate,
                    session_id=session_id,
                    priority=priority,
                    on_chunk=on_chunk,
                ),
                name=f"tts:{prefix}",
            )
        parts: list[str] = []
        req = LlmRequest(
            request_id=f"{prefix}/llm",
            messages=messages,
            max_tokens=max_tokens,
            temperature=temperature,
            priority=priority,
            session_id=session_id,
        )
        try:
            async with self.admission.slot(priority):
                async for out in self.llm.submit(req):
                    if isinstance(out, TextOut):
                        parts.append(out.text)
                        on_text(out.text)
                        if want_audio:
                            for seg in segmenter.push(out.text):
                                segq.put_nowait(seg)
                    elif isinstance(out, StageDone):
                        result.tokens = out.tokens
                        result.prompt_tokens = out.prompt_tokens
                        result.finish_reason = out.finish_reason
            if want_audio:
                for seg in segmenter.flush():
                    segq.put_nowait(seg)
                segq.put_nowait(None)
            result.text = "".join(parts)
            if speaker is not None:
                result.audio_ms = await speaker
        finally:
            if speaker is not None and not speaker.done():
                speaker.cancel()
                await asyncio.gather(speaker, return_exceptions=True)
        if result.finish_reason == "aborted":
            raise StageError("aborted", code="aborted")
        return result
