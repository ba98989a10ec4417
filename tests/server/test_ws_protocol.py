"""The WebSocket protocol the server runs under uvicorn: it reads on while fewer than
MAX_QUEUED messages wait for the app (no pause/resume system calls per frame), pauses at the
bound, and resumes once the app has drained its queue. Messages keep their order."""

from __future__ import annotations

import asyncio
from typing import Any

import uvicorn
from uvicorn.server import ServerState

from duplex_server.transports.ws_protocol import MAX_QUEUED, BufferedReadsProtocol


class _Transport:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def pause_reading(self) -> None:
        self.calls.append("pause")

    def resume_reading(self) -> None:
        self.calls.append("resume")

    def is_closing(self) -> bool:
        return False


async def _app(scope: Any, receive: Any, send: Any) -> None:  # never called here
    raise AssertionError


def test_reads_on_until_the_bound_then_pauses_and_resumes_when_drained() -> None:
    async def main() -> None:
        config = uvicorn.Config(_app, ws=BufferedReadsProtocol, log_level="warning")
        config.load()
        proto = BufferedReadsProtocol(config, ServerState(), {})
        transport = _Transport()
        proto.transport = transport  # type: ignore[assignment]

        def message(i: int) -> None:
            proto.curr_msg_data_type = "bytes"
            proto.frames = [i.to_bytes(2, "big")]
            proto.send_receive_event_to_app()

        for i in range(MAX_QUEUED - 1):
            message(i)
        assert transport.calls == []  # 15 waiting: the socket is still read
        message(MAX_QUEUED - 1)
        assert transport.calls == ["pause"]  # the bound: uvicorn's flow control takes over
        message(MAX_QUEUED)  # already paused (bytes in flight): queued, no second pause
        assert transport.calls == ["pause"]
        got = [int.from_bytes((await proto.receive())["bytes"], "big") for _ in range(17)]
        assert got == list(range(MAX_QUEUED + 1))
        assert transport.calls == ["pause", "resume"]  # resumed once the queue was empty
        message(99)
        assert transport.calls == ["pause", "resume"]

    asyncio.run(main())
