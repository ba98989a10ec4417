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
these routes. Duplex semantics hold across the network:

* the fenced stage request id travels as the ``X-Request-Id`` header (and, with
  ``request_id_field``, as the body's ``request_id``, which vLLM uses as its own id);
* a barge-in aborts by closing the stream (vLLM aborts a request whose client went away);
  nothing that arrives after the abort is emitted;
* connect errors (and 502/503/504 answers) are retried with exponential backoff while the
  request has produced nothing; a failure after output fails that request only
  (``stage_failed``: the turn ends with an error event, the session goes on);
* a circuit breaker opens after ``breaker_failures`` consecutive failures: requests then fail
  at once (``stage_unavailable``) instead of hammering a dead server, ``/health`` names the
  stage, and after ``breaker_reset_s`` one request is let through to probe it;
* a stall longer than ``read_timeout_s`` between two pieces of a stream fails the request.

The HTTP client (httpx, one connection pool per replica) runs on the orchestrator's loop:
network waits only, no compute.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
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
from engine.orchestration.edges import Edge

log = logging.getLogger(__name__)

Kind = Literal["llm", "asr", "tts"]
_EDGES: dict[str, tuple[Edge, Edge]] = {
    "llm": (Edge.TEXT, Edge.TEXT),
    "asr": (Edge.AUDIO, Edge.TEXT),
    "tts": (Edge.TEXT, Edge.AUDIO),
}
_RETRY_STATUS = frozenset({502, 503, 504})
_CLOSED: Any = object()  # the request's task has finished
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


class _Breaker:
    """Consecutive-failure circuit breaker (closed -> open -> half-open -> closed)."""

    def __init__(self, failures: int, reset_s: float) -> None:
        self.failures = failures
        self.reset_s = reset_s
        self.count = 0
        self.opened_at: float | None = None
        self.probing = False
        self.last_error = ""

    def check(self, where: str) -> None:
        if self.opened_at is None:
            return
        if time.monotonic() - self.opened_at < self.reset_s or self.probing:
            raise StageError(
                f"{where} is down ({self.last_error}); not retried for "
                f"{self.reset_s:.0f} s (circuit open)",
                code="stage_unavailable",
            )
        self.probing = True  # half-open: this request probes the server

    def success(self) -> None:
        self.count = 0
        self.opened_at = None
        self.probing = False

    def failure(self, error: str) -> None:
        self.last_error = error
        self.probing = False
        self.count += 1
        if self.count >= self.failures:
            if self.opened_at is None:
                log.error("remote stage circuit opened: %s", error)
            self.opened_at = time.monotonic()

    @property
    def down(self) -> str | None:
        return self.last_error if self.opened_at is not None else None


class _Failure(Exception):
    """A failure of the remote (counted by the breaker); ``retry`` if nothing was output."""

    def __init__(self, message: str, *, retry: bool) -> None:
        super().__init__(message)
        self.retry = retry


class OpenAIStage:
    """The StageBackend protocol over an OpenAI-compatible HTTP server."""

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
        self.base_url = options.base_url.rstrip("/")
        if not self.base_url.startswith(("http://", "https://")):
            raise ConfigError(
                f"engine.stages.{self.stage}.options.base_url: expected http(s)://..., "
                f"got {options.base_url!r}"
            )
        self.restarts = 0
        self.breaker = _Breaker(options.breaker_failures, options.breaker_reset_s)
        self._client: httpx.AsyncClient | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._aborting: set[str] = set()
        self.aborted = 0  # requests closed by an abort (their streams cut)

    @classmethod
    def cuda_device_count(cls) -> int:
        return 0

    @property
    def where(self) -> str:
        return f"remote {self.kind} stage {self.stage!r} at {self.base_url}"

    def voices(self) -> tuple[str, ...]:
        """tts: OpenAI's voice names, forwarded (``voice`` first: the default)."""
        return (self.options.voice, *OPENAI_VOICES)

    def health(self) -> str | None:
        """Why this replica is down (its circuit is open), or None."""
        down = self.breaker.down
        return f"{self.where}: {down}" if down is not None else None

    def _headers(self, rid: str) -> dict[str, str]:
        headers = {"X-Request-Id": rid}
        key = self.options.api_key
        if key is None and self.options.api_key_env:
            key = os.environ.get(self.options.api_key_env)
        if key:
            headers["Authorization"] = f"Bearer {key}"
        return headers

    async def start(self) -> None:
        o = self.options
        timeout = httpx.Timeout(o.read_timeout_s, connect=o.connect_timeout_s)
        limits = httpx.Limits(max_connections=o.pool_size, max_keepalive_connections=o.pool_size)
        self._client = httpx.AsyncClient(timeout=timeout, limits=limits)

    async def close(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def abort(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            task = self._tasks.get(rid)
            if task is not None and not task.done():
                self._aborting.add(rid)  # nothing more of it is emitted, from now
                task.cancel()  # closes the HTTP stream: the server sees the client go
                self.aborted += 1

    # ------------------------------------------------------------------ one request
    async def submit(self, request: StageRequest) -> AsyncIterator[StageOutput]:
        rid = request.request_id
        out: asyncio.Queue[Any] = asyncio.Queue()
        task = asyncio.create_task(self._run(request, out), name=f"remote:{rid}")
        task.add_done_callback(lambda _t: out.put_nowait(_CLOSED))
        self._tasks[rid] = task
        try:
            while True:
                item = await out.get()
                if rid in self._aborting or (item is _CLOSED and task.cancelled()):
                    yield StageDone(request_id=rid, finish_reason="aborted")
                    return
                if item is None or item is _CLOSED:
                    if item is _CLOSED and (exc := task.exception()) is not None:
                        raise StageError(f"{self.where}: {exc!r}")
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            self._tasks.pop(rid, None)
            self._aborting.discard(rid)

    async def _run(self, request: StageRequest, out: asyncio.Queue[Any]) -> None:
        try:
            self.breaker.check(self.where)
        except StageError as exc:
            out.put_nowait(exc)
            return
        delay = self.options.backoff_s
        produced = [False]

        def emit(item: StageOutput) -> None:
            produced[0] = True
            out.put_nowait(item)

        for attempt in range(self.options.retries + 1):
            try:
                await self._once(request, emit)
            except _Failure as exc:
                self.breaker.failure(str(exc))
                if exc.retry and not produced[0] and attempt < self.options.retries:
                    if self.breaker.down is not None:
                        out.put_nowait(StageError(f"{self.where}: {exc}", code="stage_unavailable"))
                        return
                    log.info("%s: %s; retrying in %.2f s", self.where, exc, delay)
                    await asyncio.sleep(delay)
                    delay *= 2
                    continue
                code = "stage_unavailable" if not produced[0] and exc.retry else "stage_failed"
                out.put_nowait(StageError(f"{self.where}: {exc}", code=code))
                return
            self.breaker.success()
            out.put_nowait(None)
            return

    async def _once(self, request: StageRequest, emit: Any) -> None:
        client = self._client
        if client is None:
            raise StageError(f"{self.where}: not started")
        try:
            if isinstance(request, LlmRequest):
                await self._chat(client, request, emit)
            elif isinstance(request, AsrRequest):
                await self._transcribe(client, request, emit)
            elif isinstance(request, TtsRequest):
                await self._speak(client, request, emit)
            else:
                raise StageError(f"{self.where}: unexpected {type(request).__name__}")
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
            raise _Failure(f"cannot connect: {exc!r}", retry=True) from None
        except httpx.ReadTimeout:
            raise _Failure(
                f"no data for {self.options.read_timeout_s:.0f} s (read timeout)", retry=False
            ) from None
        except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
            raise _Failure(f"the stream broke: {exc!r}", retry=False) from None

    def _body(self, rid: str, body: dict[str, Any]) -> dict[str, Any]:
        merged = {**body, **self.options.extra_body}
        if self.options.request_id_field:
            merged["request_id"] = rid
        return merged

    @staticmethod
    async def _check(resp: httpx.Response) -> None:
        if resp.status_code >= 400:
            text = (await resp.aread())[:300].decode(errors="replace")
            raise _Failure(
                f"HTTP {resp.status_code}: {text.strip()}",
                retry=resp.status_code in _RETRY_STATUS,
            )

    async def _events(
        self, client: httpx.AsyncClient, path: str, body: dict[str, Any], rid: str
    ) -> AsyncGenerator[dict[str, Any], None]:
        """POST ``body`` to ``path``, streamed (server-sent events): each event's JSON up to
        the stream's ``[DONE]``. An error event, an event that is not JSON or a stream that
        ends before ``[DONE]`` is a failure. Close it (``aclosing``) so that leaving early
        closes the connection at once, which is how the remote learns of an abort."""
        url = f"{self.base_url}{path}"
        async with client.stream("POST", url, json=body, headers=self._headers(rid)) as resp:
            await self._check(resp)
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                try:
                    chunk = json.loads(data)
                except json.JSONDecodeError:
                    msg = f"not JSON in the event stream: {data[:80]!r}"
                    raise _Failure(msg, retry=False) from None
                if "error" in chunk:
                    raise _Failure(f"the server reported: {chunk['error']}", retry=False)
                yield chunk
        raise _Failure("the event stream ended without [DONE] (truncated)", retry=False)

    # -- llm: streamed chat completions (SSE) ------------------------------------------
    async def _chat(self, client: httpx.AsyncClient, req: LlmRequest, emit: Any) -> None:
        rid = req.request_id
        body = self._body(
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
        async with aclosing(self._events(client, "/chat/completions", body, rid)) as events:
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
    async def _transcribe(self, client: httpx.AsyncClient, req: AsrRequest, emit: Any) -> None:
        rid = req.request_id
        wav = io.BytesIO()
        sf.write(wav, np.frombuffer(req.audio, dtype="<i2"), req.sample_rate, format="WAV")
        data = {
            "model": self.options.model,
            "language": self.options.language or req.language,
            "response_format": "json",
            **{k: str(v) for k, v in self.options.extra_body.items()},
        }
        url = f"{self.base_url}/audio/transcriptions"
        files = {"file": ("audio.wav", wav.getvalue(), "audio/wav")}
        resp = await client.post(url, data=data, files=files, headers=self._headers(rid))
        await self._check(resp)
        try:
            text = resp.json()["text"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise _Failure(f"not a transcription: {resp.text[:80]!r}", retry=False) from None
        emit(TranscriptOut(request_id=rid, text=str(text), final=True))
        emit(StageDone(request_id=rid))

    # -- tts: streamed pcm, resampled and re-chunked -----------------------------------
    async def _speak(self, client: httpx.AsyncClient, req: TtsRequest, emit: Any) -> None:
        rid = req.request_id
        o = self.options
        body = self._body(
            rid,
            {
                "model": o.model,
                "input": req.text,
                "voice": req.voice or o.voice,
                "speed": req.speed,
                "response_format": "pcm",
            },
        )
        url = f"{self.base_url}/audio/speech"
        resampler = StreamResampler(o.pcm_sample_rate, req.sample_rate)
        chunker = PcmChunker(req.sample_rate, o.chunk_ms)
        async with client.stream("POST", url, json=body, headers=self._headers(rid)) as resp:
            await self._check(resp)
            kind = resp.headers.get("content-type", "")
            if kind.startswith(("application/json", "text/")):
                raise _Failure(f"expected audio/pcm, got {kind}", retry=False)

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
