"""OpenAI-shaped batch API surface: request bodies, their validation, errors, body limits."""

from __future__ import annotations

import logging
from typing import Annotated, Literal, TypeVar

import msgspec
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Message

from duplex_contract.audio import INPUT_RATE
from duplex_contract.validation import explain
from duplex_contract.voices import VoiceCatalog
from duplex_server.http.codecs import (
    SpeechFormat,
)

log = logging.getLogger(__name__)

OUTPUT_RATE = 24000
ENGINE_INPUT_RATE = INPUT_RATE  # what the transcription jobs are sent at

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
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type_,
            param,
            code,
        )
        self.retry_after_s = retry_after_s  # the Retry-After header (seconds), if any

    def payload(self) -> dict[str, dict[str, str | None]]:
        err = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return {"error": err}


def error_response(exc: ApiError) -> Response:
    headers = {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s is not None else None
    return JSONResponse(exc.payload(), status_code=exc.status, headers=headers)


def validation_error(exc: msgspec.ValidationError, decoded: object = None) -> ApiError:
    """msgspec's message -> a 400 naming the field (``audio.format``, ``messages.0.role``)
    and, for a value outside a fixed set, the allowed values (``decoded``: the body type)."""
    problem = explain(exc, decoded)
    code = {
        "unknown": "unknown_parameter",
        "missing": "missing_required_parameter",
        "invalid": "invalid_value",
    }[problem.kind]
    param = problem.path or None
    text = problem.message
    return ApiError(400, f"{param}: {text}" if param else text, param=param, code=code)


def engine_voice(voices: VoiceCatalog | None, name: str | None, param: str) -> str | None:
    """The engine's voice for a request's ``name`` (an OpenAI alias is the default voice);
    400 ``invalid_value`` listing the voices for an unknown one. ``voices`` None: unchecked."""
    if voices is None or name is None:
        return name
    problem = voices.problem(name)
    if problem is not None:
        raise ApiError(400, f"{param}: {problem}", param=param, code="invalid_value")
    return voices.resolve(name)


def voice_list(voices: VoiceCatalog | None) -> dict[str, object]:
    """``GET /v1/voices``: the engine's voices (the default first) and the aliases."""
    if voices is None:
        return {"object": "list", "data": [], "default": None, "checked": False}
    data: list[dict[str, object]] = [
        {"id": v, "object": "voice", "default": i == 0} for i, v in enumerate(voices.voices)
    ]
    data += [
        {"id": a, "object": "voice", "default": False, "alias_of": voices.default}
        for a in voices.aliases
    ]
    return {"object": "list", "data": data, "default": voices.default, "checked": True}


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
        raise validation_error(exc, type_) from None
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
