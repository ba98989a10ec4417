"""Remote stages: any OpenAI-compatible server as a stage backend (``backend: openai``).

One backend, three kinds (``options.kind``, default: the stage's name when it is one):

========= ============================================= ==================================
kind      endpoint                                      edge
========= ============================================= ==================================
``llm``   ``POST {base_url}/chat/completions``, SSE     text -> text (the responder)
``asr``   ``POST {base_url}/audio/transcriptions``      audio -> text
``tts``   ``POST {base_url}/audio/speech``, pcm stream  text -> audio
========= ============================================= ==================================

So a stage can run on ``vllm serve`` (one model over many GPUs and nodes: tensor/pipeline/
data parallel, Ray), on another duplex-server's batch routes, or on any speech server with
these routes. Duplex semantics hold across the network (the fenced id as ``X-Request-Id``,
aborts that close the stream, retries before any output, a circuit breaker, a read
timeout): they are the :class:`OpenAIConnection`'s the stage holds
(engine/stages/openai_connection.py); this file says what each kind sends and how its answer
becomes outputs.
"""

from __future__ import annotations

import io
import json
import logging
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from typing import Annotated, Any, ClassVar, Literal

import httpx
import msgspec
import numpy as np
import soundfile as sf

from audio_kit.pcm import PcmChunker, StreamResampler
from duplex_contract.batch import AudioOut, TextOut, TranscriptOut
from duplex_contract.errors import ConfigError, StageError
from duplex_contract.voices import OPENAI_VOICES
from engine.messages import AsrRequest, LlmRequest, StageDone, StageOutput, StageRequest, TtsRequest
from engine.stages.edges import Edge
from engine.stages.openai_connection import Emit, OpenAIConnection, RemoteFailure, check

log = logging.getLogger(__name__)

Kind = Literal["llm", "asr", "tts"]
_EDGES: dict[str, tuple[Edge, Edge]] = {
    "llm": (Edge.TEXT, Edge.TEXT),
    "asr": (Edge.AUDIO, Edge.TEXT),
    "tts": (Edge.TEXT, Edge.AUDIO),
}
PosFloat = Annotated[float, msgspec.Meta(gt=0)]


class OpenAIOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    base_url: str  # e.g. http://10.0.0.5:8000/v1
    kind: Kind | None = None  # None: the stage's name (llm, asr or tts)
    model: str = "default"
    api_key: str | None = None
    api_key_env: str | None = None  # or read the key from this environment variable
    connect_timeout_s: PosFloat = 5.0
    read_timeout_s: PosFloat = 30.0  # longest wait for the next piece of a response
    pool_size: Annotated[int, msgspec.Meta(ge=1)] = 32  # connections per replica
    retries: Annotated[int, msgspec.Meta(ge=0)] = 3  # connect retries before any output
    backoff_s: PosFloat = 0.1  # first retry delay; doubles each time
    breaker_failures: Annotated[int, msgspec.Meta(ge=1)] = 5
    breaker_reset_s: PosFloat = 10.0
    extra_body: dict[str, Any] = {}  # merged into every request body (e.g. vLLM's priority)
    request_id_field: bool = False  # also send the fenced id as the body's request_id
    # llm
    top_p: float | None = None
    # tts: the server's voice when the session has none; the remote's pcm sample rate
    voice: str = "alloy"
    pcm_sample_rate: Annotated[int, msgspec.Meta(ge=8000)] = 24000
    chunk_ms: PosFloat = 100.0
    # asr: the transcription language when the request names none
    language: str | None = None


class OpenAIStage:
    """The StageBackend protocol over an OpenAI-compatible HTTP server.

    The stage interface is its :class:`OpenAIConnection`'s (retries, breaker, aborts); this
    class sends each request by its kind (``_chat``, ``_transcribe``, ``_speak``)."""

    Options: ClassVar[type[OpenAIOptions]] = OpenAIOptions
    device_kinds: ClassVar[frozenset[str]] = frozenset({"cpu"})  # the model runs remotely
    keeps_auto: ClassVar[bool] = False

    def __init__(
        self, options: OpenAIOptions, name: str, *, device: str = "cpu", stage: str | None = None
    ) -> None:
        self.options = options
        self.name = name
        self.device = device
        self.stage = stage or name
        kind = options.kind or self.stage
        if kind not in _EDGES:
            raise ConfigError(
                f"engine.stages.{self.stage}.options.kind: the openai backend needs a kind "
                "(llm, asr or tts) when the stage is not named after one"
            )
        self.kind: Kind = kind  # type: ignore[assignment]
        self.consumes, self.emits = _EDGES[kind]
        self.connection = OpenAIConnection(
            options, stage=self.stage, what=f"remote {self.kind} stage"
        )
        self.restarts = 0

    @classmethod
    def cuda_device_count(cls) -> int:
        return 0

    def voices(self) -> tuple[str, ...]:
        """tts: OpenAI's voice names, forwarded (``voice`` first: the default)."""
        return (self.options.voice, *OPENAI_VOICES)

    # ------------------------------------------------------------------ its connection's
    @property
    def capacity(self) -> int:
        """Request slots (engine/orchestration/scheduling.py): the connections of its pool
        (``pool_size``), the requests it has in flight at most."""
        return self.options.pool_size

    def health(self) -> str | None:
        """Why this replica is down (its circuit is open), or None."""
        return self.connection.health()

    async def start(self) -> None:
        await self.connection.start()

    def submit(self, request: StageRequest) -> AsyncIterator[StageOutput]:
        return self.connection.submit(request, self._call)

    async def abort(self, request_ids: Sequence[str]) -> None:
        await self.connection.abort(request_ids)

    async def close(self) -> None:
        await self.connection.close()

    # ------------------------------------------------------------------ one request
    async def _call(self, client: httpx.AsyncClient, request: StageRequest, emit: Emit) -> None:
        if isinstance(request, LlmRequest):
            await self._chat(client, request, emit)
        elif isinstance(request, AsrRequest):
            await self._transcribe(client, request, emit)
        elif isinstance(request, TtsRequest):
            await self._speak(client, request, emit)
        else:
            raise StageError(f"{self.connection.where}: unexpected {type(request).__name__}")

    # -- llm: streamed chat completions (SSE) ------------------------------------------
    async def _chat(self, client: httpx.AsyncClient, req: LlmRequest, emit: Emit) -> None:
        rid = req.request_id
        body = self.connection.body(
            rid,
            {
                "model": self.options.model,
                "messages": [{"role": m.role, "content": m.content} for m in req.messages],
                "max_tokens": req.max_tokens,
                "temperature": req.temperature,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
        if self.options.top_p is not None:
            body.setdefault("top_p", self.options.top_p)
        reason: Literal["stop", "length"] = "stop"
        tokens = prompt = 0
        async with aclosing(
            self.connection.events(client, "/chat/completions", body, rid)
        ) as events:
            async for chunk in events:
                usage = chunk.get("usage") or {}
                tokens = int(usage.get("completion_tokens", tokens))
                prompt = int(usage.get("prompt_tokens", prompt))
                for choice in chunk.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        emit(TextOut(request_id=rid, text=text))
                    if choice.get("finish_reason") == "length":
                        reason = "length"
        emit(StageDone(request_id=rid, finish_reason=reason, tokens=tokens, prompt_tokens=prompt))

    # -- asr: one upload, one transcript -----------------------------------------------
    async def _transcribe(self, client: httpx.AsyncClient, req: AsrRequest, emit: Emit) -> None:
        rid = req.request_id
        wav = io.BytesIO()
        sf.write(wav, np.frombuffer(req.audio, dtype="<i2"), req.sample_rate, format="WAV")
        data = {
            "model": self.options.model,
            "language": self.options.language or req.language,
            "response_format": "json",
            **{k: str(v) for k, v in self.options.extra_body.items()},
        }
        url = f"{self.connection.base_url}/audio/transcriptions"
        files = {"file": ("audio.wav", wav.getvalue(), "audio/wav")}
        resp = await client.post(url, data=data, files=files, headers=self.connection.headers(rid))
        await check(resp)
        try:
            text = resp.json()["text"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise RemoteFailure(f"not a transcription: {resp.text[:80]!r}", retry=False) from None
        emit(TranscriptOut(request_id=rid, text=str(text), final=True))
        emit(StageDone(request_id=rid))

    # -- tts: streamed pcm, resampled and re-chunked -----------------------------------
    async def _speak(self, client: httpx.AsyncClient, req: TtsRequest, emit: Emit) -> None:
        rid = req.request_id
        o = self.options
        body = self.connection.body(
            rid,
            {
                "model": o.model,
                "input": req.text,
                "voice": req.voice or o.voice,
                "speed": req.speed,
                "response_format": "pcm",
            },
        )
        url = f"{self.connection.base_url}/audio/speech"
        resampler = StreamResampler(o.pcm_sample_rate, req.sample_rate)
        chunker = PcmChunker(req.sample_rate, o.chunk_ms)
        async with client.stream(
            "POST", url, json=body, headers=self.connection.headers(rid)
        ) as resp:
            await check(resp)
            kind = resp.headers.get("content-type", "")
            if kind.startswith(("application/json", "text/")):
                raise RemoteFailure(f"expected audio/pcm, got {kind}", retry=False)

            def out(pieces: list[bytes]) -> None:
                for piece in pieces:
                    if piece:
                        now = time.monotonic_ns()
                        emit(
                            AudioOut(
                                request_id=rid, pcm=piece, sample_rate=req.sample_rate, t_ns=now
                            )
                        )

            async for data in resp.aiter_bytes():
                out(chunker.push(resampler.process(data)))
            out([*chunker.push(resampler.flush()), chunker.flush()])
        emit(StageDone(request_id=rid))


__all__ = ["OpenAIOptions", "OpenAIStage"]
