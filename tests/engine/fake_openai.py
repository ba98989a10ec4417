"""A small misbehaving OpenAI-compatible server for the remote-stage tests (real HTTP on
127.0.0.1 under uvicorn). ``mode`` picks how it answers the next requests."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route


@dataclass
class Fake:
    mode: str = "ok"  # ok | http500 | http503 | notjson | truncated | stall | slow
    fail_first: int = 0  # answer this many requests with 503 first (then as ``mode``)
    words: list[str] = field(default_factory=lambda: ["Hello", " there", ".", " Bye", "."])
    requests: list[dict[str, Any]] = field(default_factory=list)
    disconnected: int = 0  # streams whose client went away before the end
    addr: str = ""

    def app(self) -> Starlette:
        async def chat(request: Request) -> Response:
            body = await request.json()
            self.requests.append(
                {"path": "chat", "id": request.headers.get("x-request-id"), **body}
            )
            if self.fail_first > 0:
                self.fail_first -= 1
                return PlainTextResponse("warming up", status_code=503)
            if self.mode in ("http500", "http503"):
                return PlainTextResponse("boom", status_code=int(self.mode[4:]))
            if self.mode == "notjson":
                return StreamingResponse(
                    _lines(["data: {not json"]), media_type="text/event-stream"
                )

            async def events() -> AsyncIterator[bytes]:
                try:
                    for i, w in enumerate(self.words):
                        if self.mode == "stall" and i == 2:
                            await asyncio.sleep(30)
                        if self.mode == "slow":
                            await asyncio.sleep(0.05)
                        chunk = {"choices": [{"index": 0, "delta": {"content": w}}]}
                        yield f"data: {json.dumps(chunk)}\n\n".encode()
                    if self.mode == "truncated":
                        return
                    end = {
                        "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                        "usage": {"completion_tokens": len(self.words), "prompt_tokens": 7},
                    }
                    yield f"data: {json.dumps(end)}\n\ndata: [DONE]\n\n".encode()
                except asyncio.CancelledError:
                    self.disconnected += 1
                    raise

            return StreamingResponse(events(), media_type="text/event-stream")

        async def transcriptions(request: Request) -> Response:
            async with request.form() as form:
                self.requests.append({"path": "asr", "language": form.get("language")})
            if self.mode == "notjson":
                return PlainTextResponse("<html>proxy error</html>")
            return JSONResponse({"text": "what is the weather like today"})

        async def speech(request: Request) -> Response:
            body = await request.json()
            self.requests.append({"path": "tts", **body})
            if self.mode == "notjson":
                return JSONResponse({"error": "no audio here"})
            pcm = bytes(2 * 2400)  # 100 ms of silence at 24 kHz per piece

            async def audio() -> AsyncIterator[bytes]:
                for _ in range(5):
                    yield pcm

            return StreamingResponse(audio(), media_type="audio/pcm")

        return Starlette(
            routes=[
                Route("/v1/chat/completions", chat, methods=["POST"]),
                Route("/v1/audio/transcriptions", transcriptions, methods=["POST"]),
                Route("/v1/audio/speech", speech, methods=["POST"]),
            ]
        )


async def _lines(lines: list[str]) -> AsyncIterator[bytes]:
    for line in lines:
        yield (line + "\n\n").encode()


@contextlib.contextmanager
def fake_openai() -> Iterator[Fake]:
    fake = Fake()
    config = uvicorn.Config(fake.app(), host="127.0.0.1", port=0, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("fake server did not start")
        time.sleep(0.01)
    fake.addr = f"127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    try:
        yield fake
    finally:
        server.should_exit = True
        thread.join(10)
