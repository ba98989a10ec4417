"""Remote talker: the codec LM on a ``vllm serve`` pool (``backend: openai-talker``).

The talker stage (text segment -> codec codes, edge ``codec``) with its model on a vLLM
OpenAI-compatible server instead of in this process: any number of replicas behind a load
balancer, each free to use vLLM's tensor/pipeline/data parallelism and its Ray backend. The
codec decoder stays in the engine (docs/scale.md says why).

Per segment, one streamed ``POST {base_url}/completions``:

* ``prompt``: the layout's prompt as token ids (engine/codec_layout.py), tokenized here with
  the talker's own ``tokenizer.json`` (the ``tokenizer`` option: the model directory, or
  null for the tiny CI talker), so the server never re-tokenizes;
* ``vllm_xargs.codec_frames = [audio_base, codebook_size, frame_size, *end ids]``: the
  server must run the project's logits processor (``vllm serve ... --logits-processors
  engine.stages.talker_logits:CodecFrameLogits``), which keeps sampling on whole, in-range
  frames (engine/stages/talker_logits.py); ``stop_token_ids``: the layout's end ids;
* ``return_token_ids``: each SSE chunk carries the sampled token ids, converted to codes as
  the local talker does. Codes go out as whole frames only; a token outside its frame
  position's codebook, or a stream that stops mid-frame, fails the request with a message
  naming the missing processor (nothing of it is decoded).

Everything remote is the :class:`OpenAIConnection`'s it holds (engine/stages/
openai_connection.py, as the ``openai`` backend does): the fenced id as ``X-Request-Id`` (and
the body's ``request_id`` with ``request_id_field``), retries with backoff while nothing was
produced, the circuit breaker, the read timeout, and ``abort``, which closes the stream: vLLM
aborts a request whose client went away, and nothing of it is emitted after the abort.
"""

from __future__ import annotations

import zlib
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from pathlib import Path
from typing import Annotated, Any, ClassVar

import httpx
import msgspec

from duplex_contract.errors import ConfigError, StageError
from engine.codec_layout import CodecLayout, FrameError, get_layout
from engine.messages import StageDone, StageOutput, StageRequest, TokensOut, TtsRequest
from engine.stages.edges import Edge
from engine.stages.openai_connection import Emit, OpenAIConnection, RemoteFailure
from engine.stages.openai_remote import Kind, OpenAIOptions
from engine.stages.talker_vllm import LOGITS_PROCESSOR, VoiceSampling

PROCESSOR_HINT = f"is the server started with --logits-processors {LOGITS_PROCESSOR}?"


class RemoteTalkerOptions(OpenAIOptions, frozen=True, forbid_unknown_fields=True):
    """:class:`OpenAIOptions` (base_url, model, retries, breaker, ...) plus the talker's."""

    kind: Kind | None = "tts"  # the remote plumbing of a text -> speech stage
    # a directory with the talker's tokenizer.json; None: the tiny CI talker's
    tokenizer: str | None = None
    layout: str = "orpheus"  # engine/codec_layout.py
    voice: str | None = None  # type: ignore[assignment]  # None: the layout's default
    voices: dict[str, VoiceSampling] = {}
    temperature: Annotated[float, msgspec.Meta(ge=0)] = 0.6
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.8
    top_k: Annotated[int, msgspec.Meta(ge=0)] = 0
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0)] = 1.1
    max_frames: Annotated[int, msgspec.Meta(ge=1)] = 512  # per segment
    # the server's --max-model-len: caps a segment's frames to what fits; None: no cap here
    max_model_len: Annotated[int, msgspec.Meta(ge=64)] | None = None
    seed: int | None = None
    # tokens per streamed chunk (vLLM's stream_interval; the server's --stream-interval is
    # the floor); None: one frame. Fewer, larger chunks: less parsing on the engine's loop.
    stream_interval: Annotated[int, msgspec.Meta(ge=1)] | None = None
    send_priority: bool = (
        False  # send the request's priority (server: --scheduling-policy priority)
    )


class RemoteTalker:
    """Text segments -> codec codes, streamed from a vLLM server running the talker.

    The stage interface is its :class:`OpenAIConnection`'s; this class writes each segment's
    ``/completions`` body and turns the sampled token ids into whole frames of codes."""

    Options: ClassVar[type[RemoteTalkerOptions]] = RemoteTalkerOptions
    consumes: Edge = Edge.TEXT
    emits: Edge = Edge.CODEC
    device_kinds: ClassVar[frozenset[str]] = frozenset({"cpu"})  # the model runs remotely
    keeps_auto: ClassVar[bool] = False

    def __init__(
        self,
        options: RemoteTalkerOptions,
        name: str,
        *,
        device: str = "cpu",
        stage: str | None = None,
    ) -> None:
        self.topts = options
        self.name = name
        self.device = device
        self.stage = stage or name
        self.connection = OpenAIConnection(options, stage=self.stage, what="remote talker")
        self.base_url = self.connection.base_url
        field = f"engine.stages.{self.stage}.options"
        try:
            self.layout: CodecLayout = get_layout(options.layout)
        except FrameError as exc:
            raise ConfigError(f"{field}.layout: {exc}") from None
        self._tokenizer: Any = None
        self.restarts = 0

    @classmethod
    def cuda_device_count(cls) -> int:
        return 0

    def voices(self) -> tuple[str, ...]:
        default = self.topts.voice or self.layout.default_voice
        return tuple(dict.fromkeys((default, *self.layout.voices, *self.topts.voices)))

    # ------------------------------------------------------------------ its connection's
    @property
    def capacity(self) -> int:
        """Request slots (engine/orchestration/scheduling.py): the connections of its pool
        (``pool_size``), the requests it has in flight at most."""
        return self.topts.pool_size

    def health(self) -> str | None:
        """Why this replica is down (its circuit is open), or None."""
        return self.connection.health()

    async def start(self) -> None:
        self._tokenizer = load_tokenizer(self.topts.tokenizer, self.stage)
        await self.connection.start()

    def submit(self, request: StageRequest) -> AsyncIterator[StageOutput]:
        return self.connection.submit(request, self._speak)

    async def abort(self, request_ids: Sequence[str]) -> None:
        await self.connection.abort(request_ids)

    async def close(self) -> None:
        await self.connection.close()

    # ------------------------------------------------------------------ one segment
    def body(self, request: TtsRequest) -> dict[str, Any]:
        """The ``/completions`` body of one segment (the local talker's sampling)."""
        o, lay = self.topts, self.layout
        if self._tokenizer is None:
            raise StageError(f"{self.connection.where}: not started")
        voice = request.voice or o.voice
        ids = lay.prompt_ids(self._encode, request.text, voice)
        f = lay.frame_size
        frames = o.max_frames
        if o.max_model_len is not None:
            room = (o.max_model_len - len(ids)) // f
            if room < 1:
                raise StageError(
                    f"{self.connection.where}: a segment of {len(ids)} prompt tokens leaves no "
                    f"room for a frame in max_model_len={o.max_model_len}"
                )
            frames = min(frames, room)
        preset = o.voices.get(voice or lay.default_voice, VoiceSampling())
        temperature = preset.temperature if preset.temperature is not None else o.temperature
        greedy = temperature <= 0.0
        body: dict[str, Any] = {
            "model": o.model,
            "prompt": ids,
            "max_tokens": frames * f,
            "temperature": 0.0 if greedy else temperature,
            "top_p": 1.0 if greedy else (preset.top_p or o.top_p),
            "top_k": 0 if greedy else (preset.top_k if preset.top_k is not None else o.top_k),
            "repetition_penalty": preset.repetition_penalty or o.repetition_penalty,
            "stop_token_ids": list(lay.end_ids),
            "skip_special_tokens": False,
            "stream": True,
            "return_token_ids": True,
            "stream_interval": o.stream_interval or f,
            "vllm_xargs": {
                "codec_frames": [lay.audio_base, lay.codebook_size, f, *lay.end_ids],
            },
        }
        if o.seed is not None:
            body["seed"] = o.seed ^ zlib.crc32(request.request_id.encode())
        if o.send_priority:
            body["priority"] = int(request.priority)
        return self.connection.body(request.request_id, body)

    def _encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=True).ids)

    async def _speak(self, client: httpx.AsyncClient, req: StageRequest, emit: Emit) -> None:
        if not isinstance(req, TtsRequest):
            raise StageError(f"{self.connection.where}: unexpected {type(req).__name__}")
        rid = req.request_id
        lay = self.layout
        f = lay.frame_size
        try:
            body = self.body(req)
        except StageError as exc:
            emit(exc)  # a segment that can't fit: this request fails, not the remote
            return
        pending: list[int] = []  # codes of the frame being sampled
        sent = 0  # codes emitted (whole frames)
        reason: str | None = None
        ended = False
        async with aclosing(self.connection.events(client, "/completions", body, rid)) as events:
            async for chunk in events:
                for choice in (chunk.get("choices") or [])[:1]:
                    tokens = choice.get("token_ids")
                    if tokens is None:
                        raise RemoteFailure(
                            "no token_ids in the stream (a vLLM server with return_token_ids "
                            "is needed)",
                            retry=False,
                        )
                    for token in tokens:
                        if ended or token in lay.end_ids:
                            ended = True
                            continue
                        try:
                            code = lay.token_to_code(int(token), len(pending))
                        except FrameError as exc:
                            raise RemoteFailure(f"{exc} ({PROCESSOR_HINT})", retry=False) from None
                        pending.append(code)
                        if len(pending) == f:
                            emit(TokensOut(request_id=rid, ids=tuple(pending)))
                            sent += f
                            pending.clear()
                    reason = choice.get("finish_reason") or reason
        if pending:
            raise RemoteFailure(
                f"the talker stopped {len(pending)} codes into a frame of {f} ({PROCESSOR_HINT})",
                retry=False,
            )
        if reason not in ("stop", "length"):
            raise RemoteFailure(f"the request ended with {reason!r}", retry=False)
        emit(
            StageDone(
                request_id=rid,
                finish_reason="stop" if reason == "stop" else "length",
                tokens=sent,
                prompt_tokens=len(body["prompt"]),
            )
        )


def load_tokenizer(path: str | None, stage: str) -> Any:
    """The talker's fast tokenizer (``tokenizer.json``), for prompts as token ids."""
    where = f"engine.stages.{stage}.options.tokenizer"
    if path is None:
        from engine.talker_prepare import is_prepared, tiny_talker_dir

        directory = tiny_talker_dir()
        if not is_prepared(directory):
            raise ConfigError(
                f"{where}: null means the tiny CI talker, which is not made yet "
                "(python -m engine.talker_prepare, in the vLLM venv)"
            )
    else:
        directory = Path(path)
    file = directory / "tokenizer.json" if directory.is_dir() else directory
    if not file.is_file():
        raise ConfigError(
            f"{where}: no tokenizer.json at {file} (the talker model's directory, or the file)"
        )
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:
        raise ConfigError(f"{where}: the remote talker needs `tokenizers` ({exc})") from None
    return Tokenizer.from_file(str(file))


__all__ = ["RemoteTalker", "RemoteTalkerOptions", "load_tokenizer"]
