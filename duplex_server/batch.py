"""HTTP batch routes (OpenAI-compatible) on the same engine as the sessions, at batch priority.

``POST /v1/audio/speech``, ``POST /v1/chat/completions``, ``POST /v1/audio/transcriptions``,
``GET /v1/models``. Bodies are decoded once at the edge into msgspec structs that refuse
unknown fields (as OpenAI does); every refusal is an OpenAI-shaped error::

    400 {"error": {"message", "type": "invalid_request_error", "param", "code"}}
    413 body over ``BatchConfig.max_body_bytes`` (``max_json_bytes`` for JSON bodies)
    503 engine not ready / stopped, 500 a stage failed the request

The engine schedules real-time session work ahead of batch work (engine Priority), so a
burst here does not starve sessions (bench/batch.py measures by how much it moves TTFA).
A client that goes away mid-stream cancels the generator, which aborts the engine job.
"""

from __future__ import annotations

import base64
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Literal, TypeVar

import msgspec
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route
from starlette.types import Message

from duplex_server.codecs import (
    CONTENT_TYPES,
    AudioDecodeError,
    SpeechFormat,
    StreamEncoder,
    decode_audio,
)
from duplex_server.config import BatchConfig
from engine.client import AsyncEngine
from engine.errors import EngineDeadError, EngineError
from engine.messages import (
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

log = logging.getLogger(__name__)
__all__ = ["BatchConfig", "routes"]  # BatchConfig lives in duplex_server.config

OUTPUT_RATE = 24000
ENGINE_INPUT_RATE = 16000

T = TypeVar("T")
MiB = 1024 * 1024


# ============================================================================ errors
class ApiError(Exception):
    """An OpenAI-shaped error response."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        *,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type_,
            param,
            code,
        )

    def payload(self) -> dict[str, dict[str, str | None]]:
        err = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return {"error": err}


def error_response(exc: ApiError) -> Response:
    return JSONResponse(exc.payload(), status_code=exc.status)


_PATH_RE = re.compile(r" - at `\$\.?(?P<path>[^`]*)`$")
_FIELD_RE = re.compile(r"Object (?P<what>contains unknown|missing required) field `(?P<f>[^`]+)`")


def validation_error(exc: msgspec.ValidationError) -> ApiError:
    """msgspec's message -> a 400 naming the field (``audio.format``, ``messages.0.role``)."""
    text = str(exc)
    path = ""
    if match := _PATH_RE.search(text):
        path = re.sub(r"\[(\d+)\]", r".\1", match.group("path"))
        text = text[: match.start()]
    code = "invalid_value"
    if field := _FIELD_RE.match(text):
        path = f"{path}.{field.group('f')}" if path else field.group("f")
        unknown = field.group("what") == "contains unknown"
        code = "unknown_parameter" if unknown else "missing_required_parameter"
    param = path or None
    return ApiError(400, f"{param}: {text}" if param else text, param=param, code=code)


# ============================================================================ bodies
class _Body(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    pass


Speed = Annotated[float, msgspec.Meta(ge=0.25, le=4.0)]
Text = Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]
Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=2.0)]
Tokens = Annotated[int, msgspec.Meta(ge=1)]


class SpeechRequest(_Body, frozen=True):
    model: str
    input: Text
    voice: str | None = None
    response_format: SpeechFormat = "mp3"
    speed: Speed = 1.0
    stream_format: Literal["audio", "sse"] = "audio"
    instructions: str | None = None  # accepted; the embedded voices take no style prompt


class TextPart(_Body, frozen=True, tag_field="type", tag="text"):
    text: str


class InputAudio(_Body, frozen=True):
    data: str  # base64
    format: Literal["wav", "mp3", "flac", "opus"]


class AudioPart(_Body, frozen=True, tag_field="type", tag="input_audio"):
    input_audio: InputAudio


class ChatMessageIn(_Body, frozen=True):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart | AudioPart] | None = None
    name: str | None = None


class ChatAudio(_Body, frozen=True):
    voice: str
    format: Literal["wav", "mp3", "flac", "opus", "pcm16"]


class StreamOptions(_Body, frozen=True):
    include_usage: bool = False


class ChatRequest(_Body, frozen=True):
    model: str
    messages: Annotated[list[ChatMessageIn], msgspec.Meta(min_length=1)]
    modalities: list[Literal["text", "audio"]] | None = None
    audio: ChatAudio | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Tokens | None = None
    max_completion_tokens: Tokens | None = None
    temperature: Temperature | None = None
    n: Annotated[int, msgspec.Meta(ge=1, le=1)] | None = None  # one choice only
    # accepted with no effect on the embedded models:
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None


class TranscriptionParams(msgspec.Struct, frozen=True):
    file: bytes
    language: str
    response_format: Literal["json", "text", "verbose_json"]


_TRANSCRIBE_FIELDS = frozenset(
    {
        "file",
        "model",
        "language",
        "prompt",
        "response_format",
        "temperature",
        "timestamp_granularities[]",
        "chunking_strategy",
        "include[]",
    }
)


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, or 413 as soon as it is larger than ``limit``."""
    declared = request.headers.get("content-length")
    too_big = ApiError(413, f"request body is larger than {limit} bytes", code="request_too_large")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


async def read_json(request: Request, type_: type[T], limit: int) -> T:
    body = await read_body(request, limit)
    try:
        return msgspec.json.decode(body, type=type_)
    except msgspec.ValidationError as exc:
        raise validation_error(exc) from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from None


async def transcription_params(request: Request, body: bytes) -> TranscriptionParams:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await request.receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    try:
        form = await Request(request.scope, replay).form()
    except HTTPException as exc:
        raise ApiError(400, f"invalid multipart body: {exc.detail}", code="invalid_body") from None
    try:
        for key in form:
            if key not in _TRANSCRIBE_FIELDS:
                raise ApiError(
                    400, f"unknown parameter {key!r}", param=key, code="unknown_parameter"
                )
        upload = form.get("file")
        if upload is None or isinstance(upload, str):
            raise ApiError(
                400,
                "file: a file upload is required",
                param="file",
                code="missing_required_parameter",
            )
        if not isinstance(form.get("model"), str):
            raise ApiError(
                400, "model is required", param="model", code="missing_required_parameter"
            )
        fmt = form.get("response_format", "json")
        if fmt not in ("json", "text", "verbose_json"):
            raise ApiError(
                400,
                f"response_format {fmt!r} is not supported (json, text, verbose_json)",
                param="response_format",
                code="unsupported_value",
            )
        language = form.get("language") or "en"
        data = await upload.read()
    finally:
        await form.close()
    assert isinstance(language, str)
    return TranscriptionParams(file=data, language=language, response_format=fmt)  # type: ignore[arg-type]


async def chat_job(body: ChatRequest, transcribe: Callable[[bytes], Awaitable[str]]) -> ChatJob:
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
        voice=body.audio.voice if body.audio is not None else None,
        sample_rate=OUTPUT_RATE,
    )


def sse(obj: object) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


@dataclass(slots=True)
class _Api:
    get_engine: Callable[[], AsyncEngine | None]
    config: BatchConfig
    model_name: str

    def engine(self) -> AsyncEngine:
        engine = self.get_engine()
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
            raise ApiError(500, exc.message, "server_error", code=exc.code) from None

    # ---------------------------------------------------------------- routes
    async def models(self, request: Request) -> Response:
        names = [self.model_name, *self.config.model_aliases]
        data = [
            {"id": n, "object": "model", "created": 0, "owned_by": "duplex-server"} for n in names
        ]
        return JSONResponse({"object": "list", "data": data})

    async def speech(self, request: Request) -> Response:
        body = await read_json(request, SpeechRequest, self.config.max_body_bytes)
        job = SpeechJob(
            text=body.input, voice=body.voice, speed=body.speed, sample_rate=OUTPUT_RATE
        )
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
        job = await chat_job(body, self._transcribe_part)
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
    get_engine: Callable[[], AsyncEngine | None],
    config: BatchConfig | None = None,
    model_name: str = "duplex",
) -> list[BaseRoute]:
    """The batch routes. ``get_engine`` returns the app's engine (None while it starts)."""
    api = _Api(get_engine, config or BatchConfig(), model_name)

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
        Route("/v1/audio/speech", guarded(api.speech), methods=["POST"]),
        Route("/v1/chat/completions", guarded(api.chat), methods=["POST"]),
        Route("/v1/audio/transcriptions", guarded(api.transcriptions), methods=["POST"]),
    ]
