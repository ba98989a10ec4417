"""Helpers for driving ``/v1/live/sessions`` with OpenAI's own SDK (``client.live``),
unmodified: only ``base_url`` / ``websocket_base_url`` point at the test server.

:class:`LiveCall` runs one SDK connection: it reads every server event in a task (with its
arrival time), streams PCM16 at real time the way an app with a microphone does (20 ms
appends), and plays the reply audio the way a speaker does (what arrived plays after what
is already playing), so a test can say when the user heard the audio stop.
:class:`CutProxy` is a TCP proxy whose connections a test can cut (a network drop).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from openai import AsyncOpenAI

from tests.server.harness import UNIT

RATE = 24000
FRAME_MS = 20


def sdk(addr: str) -> AsyncOpenAI:
    return AsyncOpenAI(
        api_key="unused", base_url=f"http://{addr}/v1", websocket_base_url=f"ws://{addr}/v1"
    )


class LiveCall:
    """One SDK Live connection: every event as it arrives, and a speaker's clock."""

    def __init__(self, conn: Any, rate: int = RATE, sample_width: int = 2) -> None:
        self.conn = conn
        self.rate = rate
        self.width = sample_width
        self.events: list[tuple[float, Any]] = []
        self.play_end = 0.0  # when the audio received so far has played out (monotonic)
        self.audio_bytes = 0
        self.closed = asyncio.Event()
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        try:
            async for event in self.conn:
                now = time.monotonic()
                if event.type == "session.output_audio.delta":
                    data = base64.b64decode(event.delta)
                    self.audio_bytes += len(data)
                    ms = len(data) / self.width * 1000 / self.rate
                    self.play_end = max(self.play_end, now) + ms / 1000
                self.events.append((now, event))
        finally:
            self.closed.set()

    def played_out(self, last: float) -> float:
        """When the audio that arrived up to ``last`` (monotonic) has played out at a
        speaker that plays what arrives after what is already playing."""
        end = 0.0
        for t, e in self.events:
            if t > last:
                break
            if e.type == "session.output_audio.delta":
                ms = len(base64.b64decode(e.delta)) / self.width * 1000 / self.rate
                end = max(end, t) + ms / 1000
        return end

    def of(self, kind: str) -> list[Any]:
        return [e for _, e in self.events if e.type == kind]

    def kinds(self) -> list[str]:
        return [e.type for _, e in self.events if e.type != "session.output_audio.delta"]

    def times(self, kind: str) -> list[float]:
        return [t for t, e in self.events if e.type == kind]

    async def until(
        self,
        kind: str,
        within: float = 10.0,
        pred: Callable[[Any], bool] | None = None,
        after: int = 0,
    ) -> Any:
        deadline = time.monotonic() + within * UNIT
        while True:
            for _, event in self.events[after:]:
                if event.type == kind and (pred is None or pred(event)):
                    return event
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {kind} in time; got {self.kinds()[-30:]}")
            if self.closed.is_set():
                raise ConnectionError(f"closed before {kind}; got {self.kinds()[-30:]}")
            await asyncio.sleep(0.01)

    async def stream(self, pcm: bytes, *, frame_ms: int = FRAME_MS) -> None:
        """Append ``pcm`` (the session format) at real time, ``frame_ms`` a frame."""
        step = int(self.rate * frame_ms / 1000) * self.width
        start = time.monotonic()
        for n, i in enumerate(range(0, len(pcm), step)):
            await self.conn.session.input_audio.append(
                audio=base64.b64encode(pcm[i : i + step]).decode()
            )
            wait = start + (n + 1) * frame_ms / 1000 - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)

    def transcript(self, kind: str = "session.output_transcript.delta", after: int = 0) -> str:
        return "".join(e.delta for _, e in self.events[after:] if e.type == kind)

    async def stop(self) -> None:
        self._reader.cancel()
        with contextlib.suppress(BaseException):
            await self._reader


@contextlib.asynccontextmanager
async def live_call(addr: str, session: dict[str, Any], **connect: Any) -> AsyncIterator[LiveCall]:
    """An SDK connection that has sent ``session.start`` and got ``session.started``."""
    client = sdk(addr)
    try:
        async with client.live.connect(**connect) as conn:
            await conn.session.start(session=session)  # type: ignore[arg-type]
            call = LiveCall(conn)
            try:
                await call.until("session.started")
                yield call
            finally:
                await call.stop()
    finally:
        await client.close()


class CutProxy:
    """A TCP proxy to ``target``; :meth:`cut` drops every connection (a network drop)."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.server: asyncio.Server | None = None
        self.writers: list[asyncio.StreamWriter] = []
        self.addr = ""

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        self.addr = f"127.0.0.1:{port}"
        return self.addr

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        self.writers += [writer, up_writer]

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError, asyncio.CancelledError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            with contextlib.suppress(Exception):
                dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def cut(self) -> None:
        for w in self.writers:
            transport = w.transport
            transport.abort()
        self.writers.clear()

    async def close(self) -> None:
        self.cut()
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
