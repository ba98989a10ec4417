"""HTTP batch routes (OpenAI-compatible) on the same engine as the sessions, at batch priority.

``POST /v1/audio/speech``, ``POST /v1/chat/completions``, ``POST /v1/audio/transcriptions``,
``GET /v1/models``, ``GET /v1/voices`` (the voices a request may name; others are refused).
Bodies are decoded once at the edge into msgspec structs that refuse unknown fields (as
OpenAI does; see ``batch_api.py``); every refusal is an OpenAI-shaped error::

    400 {"error": {"message", "type": "invalid_request_error", "param", "code"}}
    413 body over ``BatchConfig.max_body_bytes`` (``max_json_bytes`` for JSON bodies)
    503 engine not ready / stopped (``Retry-After: 2`` while the engine restarts), 500 a
        stage failed the request

The engine schedules real-time session work ahead of batch work (stage priority, and
``engine/orchestration/admission.py``: batch stage requests wait while a session waits for its first
output), so a burst here barely moves session TTFA (bench/batch.py measures by how much).
A client that goes away mid-stream cancels the generator, which aborts the engine job.
"""

from __future__ import annotations

import base64
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Literal

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from duplex_contract.batch import (
    AudioOut,
    BatchDone,
    BatchItem,
    BatchJob,
    ChatJob,
    ChatMessage,
    SpeechJob,
    TextOut,
    TranscribeJob,
    TranscriptOut,
)
from duplex_contract.errors import EngineDeadError, EngineError
from duplex_contract.voices import VoiceCatalog
from duplex_server.config import BatchConfig
from duplex_server.http.batch_api import (
    ENGINE_INPUT_RATE,
    OUTPUT_RATE,
    ApiError,
    ChatRequest,
    SpeechRequest,
    TextPart,
    engine_voice,
    error_response,
    read_body,
    read_json,
    transcription_params,
    voice_list,
)
from duplex_server.http.codecs import (
    CONTENT_TYPES,
    AudioDecodeError,
    SpeechFormat,
    StreamEncoder,
    decode_audio,
)
from engine.api.client import EngineClient

log = logging.getLogger(__name__)
__all__ = ["BatchConfig", "routes"]  # BatchConfig lives in duplex_server.config


MiB = 1024 * 1024
#: the retry hint (``Retry-After``, seconds) while the engine restarts (docs/scale.md)
RESTART_RETRY_S = 2


async def chat_job(
    body: ChatRequest,
    transcribe: Callable[[bytes], Awaitable[str]],
    voices: VoiceCatalog | None = None,
) -> ChatJob:
    """The engine job of a chat request; ``input_audio`` parts go through the ASR stage."""
    modalities = body.modalities or ["text"]
    want_audio = "audio" in modalities
    if want_audio and body.audio is None:
        raise ApiError(
            400,
            'audio: required when modalities contains "audio"',
            param="audio",
            code="missing_required_parameter",
        )
    voice = body.audio.voice if body.audio is not None else None
    voice = engine_voice(voices, voice, "audio.voice")
    messages: list[ChatMessage] = []
    for i, msg in enumerate(body.messages):
        role: Literal["system", "user", "assistant"] = (
            "system" if msg.role == "developer" else msg.role
        )
        if msg.content is None or isinstance(msg.content, str):
            text = msg.content or ""
        else:
            texts: list[str] = []
            for j, part in enumerate(msg.content):
                if isinstance(part, TextPart):
                    texts.append(part.text)
                    continue
                where = f"messages.{i}.content.{j}.input_audio.data"
                try:
                    pcm, _ = decode_audio(
                        base64.b64decode(part.input_audio.data), ENGINE_INPUT_RATE
                    )
                except (ValueError, AudioDecodeError) as exc:
                    raise ApiError(
                        400, f"{where}: {exc}", param=where, code="invalid_value"
                    ) from None
                texts.append(await transcribe(pcm))
            text = " ".join(t for t in texts if t)
        messages.append(ChatMessage(role, text))
    return ChatJob(
        messages=tuple(messages),
        max_tokens=body.max_completion_tokens or body.max_tokens or 256,
        temperature=body.temperature or 0.0,
        audio=want_audio,
        voice=voice,
        sample_rate=OUTPUT_RATE,
    )


def sse(obj: object) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


@dataclass(slots=True)
class _Api:
    get_engine: Callable[[], EngineClient | None]
    config: BatchConfig
    model_name: str
    voices: VoiceCatalog | None

    def engine(self) -> EngineClient:
        engine = self.get_engine()
        if engine is not None and engine.restarting:  # it comes back in seconds
            raise ApiError(
                503,
                "the engine is restarting; try again shortly",
                "server_error",
                code="engine_unavailable",
                retry_after_s=RESTART_RETRY_S,
            )
        if engine is None or not engine.ready:
            raise ApiError(
                503, "the engine is not ready", "server_error", code="engine_unavailable"
            )
        return engine

    async def run(self, job: BatchJob) -> AsyncIterator[BatchItem]:
        """The engine's items; engine errors become ApiErrors (before the first byte only)."""
        try:
            async for item in self.engine().generate(job):
                yield item
        except EngineDeadError as exc:
            raise ApiError(503, exc.message, "server_error", code=exc.code) from None
        except EngineError as exc:
            log.warning("batch job failed: %s (%s)", exc.message, exc.code)
            # a retryable refusal (server_busy: no room beside the real-time work) is a 503
            status = 503 if exc.retryable else 500
            raise ApiError(status, exc.message, "server_error", code=exc.code) from None

    # ---------------------------------------------------------------- routes
    async def models(self, request: Request) -> Response:
        names = [self.model_name, *self.config.model_aliases]
        data = [
            {"id": n, "object": "model", "created": 0, "owned_by": "duplex-server"} for n in names
        ]
        return JSONResponse({"object": "list", "data": data})

    async def voices_route(self, request: Request) -> Response:
        return JSONResponse(voice_list(self.voices))

    async def speech(self, request: Request) -> Response:
        body = await read_json(request, SpeechRequest, self.config.max_body_bytes)
        voice = engine_voice(self.voices, body.voice, "voice")
        job = SpeechJob(text=body.input, voice=voice, speed=body.speed, sample_rate=OUTPUT_RATE)
        items = self.run(job)
        first = await _first(items)  # engine errors surface as a status code, not a cut stream
        done: list[BatchDone] = []
        chunks = self._speech_bytes(_chain(first, items, done), body.response_format)
        if body.stream_format == "sse":
            return StreamingResponse(_speech_sse(chunks, body.input, done), media_type=_SSE)
        return StreamingResponse(chunks, media_type=CONTENT_TYPES[body.response_format])

    @staticmethod
    async def _speech_bytes(
        items: AsyncIterator[BatchItem], fmt: SpeechFormat
    ) -> AsyncIterator[bytes]:
        enc = StreamEncoder(fmt, OUTPUT_RATE)
        async for item in items:
            if isinstance(item, AudioOut) and (data := enc.feed(item.pcm)):
                yield data
        if tail := enc.finish():
            yield tail

    async def chat(self, request: Request) -> Response:
        body = await read_json(request, ChatRequest, self.config.max_body_bytes)
        job = await chat_job(body, self._transcribe_part, self.voices)
        want_audio = job.audio
        assert body.audio is not None or not want_audio
        fmt = body.audio.format if body.audio is not None else "pcm16"
        items = self.run(job)
        first = await _first(items)
        ctx = _ChatCtx(
            id=f"chatcmpl-{uuid.uuid4().hex}",
            audio_id=f"audio_{uuid.uuid4().hex}",
            created=int(time.time()),
            model=body.model,
            encoder=StreamEncoder("pcm" if fmt == "pcm16" else fmt, OUTPUT_RATE)
            if want_audio
            else None,
        )
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(
                self._chat_stream(ctx, first, items, include_usage), media_type=_SSE
            )
        text: list[str] = []
        audio: list[bytes] = []
        done: BatchDone | None = None
        async for item in _chain(first, items):
            if isinstance(item, TextOut):
                text.append(item.text)
            elif isinstance(item, AudioOut) and ctx.encoder is not None:
                audio.append(ctx.encoder.feed(item.pcm))
            elif isinstance(item, BatchDone):
                done = item
        content = "".join(text)
        message: dict[str, object] = {"role": "assistant", "content": content, "refusal": None}
        if ctx.encoder is not None:
            audio.append(ctx.encoder.finish())
            message["audio"] = {
                "id": ctx.audio_id,
                "data": _b64(b"".join(audio)),
                "expires_at": ctx.created + 3600,
                "transcript": content,
            }
        choice = {"index": 0, "message": message, "finish_reason": _finish(done)}
        return JSONResponse(
            {
                "id": ctx.id,
                "object": "chat.completion",
                "created": ctx.created,
                "model": ctx.model,
                "choices": [choice],
                "usage": _usage(done),
            }
        )

    async def _chat_stream(
        self,
        ctx: _ChatCtx,
        first: BatchItem | None,
        items: AsyncIterator[BatchItem],
        include_usage: bool,
    ) -> AsyncIterator[bytes]:
        done: BatchDone | None = None
        yield ctx.chunk({"role": "assistant", "content": ""})
        try:
            async for item in _chain(first, items):
                if isinstance(item, TextOut):
                    yield ctx.chunk({"content": item.text})
                elif isinstance(item, AudioOut) and ctx.encoder is not None:
                    if data := ctx.encoder.feed(item.pcm):
                        yield ctx.chunk({"audio": ctx.audio(data, item.text)})
                elif isinstance(item, BatchDone):
                    done = item
            if ctx.encoder is not None and (tail := ctx.encoder.finish()):
                yield ctx.chunk({"audio": ctx.audio(tail, "")})
        except ApiError as exc:
            yield sse(exc.payload())
            return
        yield ctx.chunk({}, finish_reason=_finish(done))
        if include_usage:
            yield ctx.sse({"choices": [], "usage": _usage(done)})
        yield b"data: [DONE]\n\n"

    async def _transcribe_part(self, pcm: bytes) -> str:
        text = ""
        async for item in self.run(TranscribeJob(audio=pcm, sample_rate=ENGINE_INPUT_RATE)):
            if isinstance(item, TranscriptOut) and item.final:
                text = item.text
        return text

    async def transcriptions(self, request: Request) -> Response:
        body = await read_body(request, self.config.max_body_bytes)
        params = await transcription_params(request, body)
        try:
            pcm, duration = decode_audio(params.file, ENGINE_INPUT_RATE)
        except AudioDecodeError as exc:
            raise ApiError(400, str(exc), param="file", code="invalid_file") from None
        job = TranscribeJob(audio=pcm, sample_rate=ENGINE_INPUT_RATE, language=params.language)
        text = ""
        async for item in self.run(job):
            if isinstance(item, TranscriptOut) and item.final:
                text = item.text
        if params.response_format == "text":
            return PlainTextResponse(text + "\n")
        if params.response_format == "json":
            return JSONResponse({"text": text, "usage": {"type": "duration", "seconds": duration}})
        segment = {
            "id": 0,
            "seek": 0,
            "start": 0.0,
            "end": round(duration, 3),
            "text": text,
            "tokens": [],
            "temperature": 0.0,
            "avg_logprob": 0.0,
            "compression_ratio": 0.0,
            "no_speech_prob": 0.0,
        }
        return JSONResponse(
            {
                "task": "transcribe",
                "language": params.language,
                "duration": round(duration, 3),
                "text": text,
                "segments": [segment] if text else [],
            }
        )


_SSE = "text/event-stream"


@dataclass(slots=True)
class _ChatCtx:
    id: str
    audio_id: str
    created: int
    model: str
    encoder: StreamEncoder | None

    def sse(self, extra: dict[str, object]) -> bytes:
        head = {"id": self.id, "object": "chat.completion.chunk", "created": self.created}
        return sse({**head, "model": self.model, **extra})

    def chunk(self, delta: dict[str, object], finish_reason: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
        return self.sse({"choices": [choice]})

    def audio(self, data: bytes, transcript: str) -> dict[str, object]:
        return {
            "id": self.audio_id,
            "data": _b64(data),
            "transcript": transcript,
            "expires_at": self.created + 3600,
        }


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _finish(done: BatchDone | None) -> str:
    return "length" if done is not None and done.finish_reason == "length" else "stop"


def _usage(done: BatchDone | None) -> dict[str, int]:
    p = done.prompt_tokens if done is not None else 0
    c = done.completion_tokens if done is not None else 0
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


async def _first(items: AsyncIterator[BatchItem]) -> BatchItem | None:
    return await anext(items, None)


async def _chain(
    first: BatchItem | None, items: AsyncIterator[BatchItem], done: list[BatchDone] | None = None
) -> AsyncIterator[BatchItem]:
    """``first`` then the rest; the BatchDone (if any) is also appended to ``done``."""
    if first is None:
        return
    yield first
    async for item in items:
        if isinstance(item, BatchDone) and done is not None:
            done.append(item)
        yield item


async def _speech_sse(
    chunks: AsyncIterator[bytes], text: str, done: list[BatchDone]
) -> AsyncIterator[bytes]:
    try:
        async for data in chunks:
            yield sse({"type": "speech.audio.delta", "audio": _b64(data)})
    except ApiError as exc:
        yield sse({"type": "error", "error": exc.payload()["error"]})
        return
    # The embedded models have no tokenizer here: usage counts words in and audio ms out.
    words = len(text.split())
    audio_ms = int(done[0].audio_ms) if done else 0
    usage = {"input_tokens": words, "output_tokens": audio_ms, "total_tokens": words + audio_ms}
    yield sse({"type": "speech.audio.done", "usage": usage})


def routes(
    get_engine: Callable[[], EngineClient | None],
    config: BatchConfig | None = None,
    model_name: str = "duplex",
    voices: VoiceCatalog | None = None,
) -> list[BaseRoute]:
    """The batch routes. ``get_engine`` returns the app's engine (None while it starts);
    ``voices``: the engine's (None: voice names are not checked)."""
    api = _Api(get_engine, config or BatchConfig(), model_name, voices)

    def guarded(
        handler: Callable[[Request], Awaitable[Response]],
    ) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            try:
                return await handler(request)
            except ApiError as exc:
                return error_response(exc)

        return endpoint

    return [
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/voices", api.voices_route, methods=["GET"]),
        Route("/v1/audio/speech", guarded(api.speech), methods=["POST"]),
        Route("/v1/chat/completions", guarded(api.chat), methods=["POST"]),
        Route("/v1/audio/transcriptions", guarded(api.transcriptions), methods=["POST"]),
    ]
