"""The WebSocket protocol the server runs under uvicorn: it reads on while fewer than
MAX_QUEUED messages wait for the app (no pause/resume system calls per frame), pauses at the
bound, and resumes once the app has drained its queue. Messages keep their order."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import uvicorn
from uvicorn.server import ServerState

from duplex_server.transports.ws_protocol import (
    MAX_QUEUED,
    SCOPE_KEY,
    BufferedReadsProtocol,
    CorkedTransport,
)


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


class _WriteTransport(_Transport):
    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closed = False
        self.aborted = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True

    def get_write_buffer_size(self) -> int:
        return 7


def test_writes_of_one_loop_iteration_go_out_as_one_write() -> None:
    async def main() -> None:
        raw = _WriteTransport()
        cork = CorkedTransport(raw, asyncio.get_running_loop())  # type: ignore[arg-type]
        cork.write(b"ab")
        cork.write(b"")
        cork.write(b"cd")
        assert raw.writes == []  # nothing yet: the iteration goes on
        assert cork.get_write_buffer_size() == 7 + 4  # the transport's and the pending
        await asyncio.sleep(0)
        assert raw.writes == [b"abcd"]  # one write, in order
        cork.write(b"ef")
        await asyncio.sleep(0)
        assert raw.writes == [b"abcd", b"ef"]
        cork.write(b"gh")
        cork.close()  # what is pending goes out before the close
        assert raw.writes == [b"abcd", b"ef", b"gh"] and raw.closed
        await asyncio.sleep(0)
        assert raw.writes == [b"abcd", b"ef", b"gh"]  # the scheduled flush finds nothing
        cork.write(b"ij")
        cork.abort()  # an abort drops it
        await asyncio.sleep(0)
        assert raw.aborted and raw.writes == [b"abcd", b"ef", b"gh"]
        assert cork.is_closing() is False  # the rest is the transport's

    asyncio.run(main())


def test_direct_delivery_keeps_the_order_of_messages_already_queued() -> None:
    async def main() -> None:
        config = uvicorn.Config(_app, ws=BufferedReadsProtocol, log_level="warning")
        config.load()
        proto = BufferedReadsProtocol(config, ServerState(), {})
        proto.transport = _Transport()  # type: ignore[assignment]
        got: list[object] = []

        def message(kind: str, payload: bytes) -> None:
            proto.curr_msg_data_type = kind
            proto.frames = [payload[:1], payload[1:]]  # a message in two frames
            proto.send_receive_event_to_app()

        message("bytes", b"q1")
        message("text", b"q2")
        proto.direct = lambda text, data: got.append(text if data is None else data)
        message("bytes", b"q3")  # two wait in the queue: this one joins them
        assert got == []
        first = await proto.receive()
        second = await proto.receive()
        third = await proto.receive()
        assert [first["bytes"], second["text"], third["bytes"]] == [b"q1", "q2", b"q3"]
        message("bytes", b"d1")  # the queue is empty: straight to the handler
        message("text", "d2 é".encode())
        assert got == [b"d1", "d2 é"]
        assert proto.queue.empty()
        proto.direct = None
        message("bytes", b"q4")  # no handler: the ASGI way again
        assert (await proto.receive())["bytes"] == b"q4" and got == [b"d1", "d2 é"]

    asyncio.run(main())


def test_a_real_connection_delivers_directly_echoes_and_closes_1011_when_the_handler_fails() -> (
    None
):
    """uvicorn with this protocol on 127.0.0.1 and a websockets client: the app finds the
    protocol in its scope, takes messages directly, answers with send_text_now; a handler
    that raises closes the connection with 1011, and the app still sees the disconnect."""
    import websockets

    seen: list[object] = []
    ended: list[object] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        assert (await receive())["type"] == "websocket.connect"
        await send({"type": "websocket.accept"})
        proto = scope["extensions"][SCOPE_KEY]

        def handle(text: str | None, data: bytes | None) -> None:
            if data == b"boom":
                raise RuntimeError("handler bug")
            seen.append(text if data is None else data)
            assert proto.send_text_now(f"got {len(seen)}".encode())

        proto.direct = handle
        ended.append(await receive())

    async def main() -> None:
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=0,
            ws=BufferedReadsProtocol,
            log_level="critical",
            lifespan="off",
        )
        server = uvicorn.Server(config)
        task = asyncio.create_task(server.serve())
        for _ in range(1000):
            if server.started:
                break
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        try:
            async with websockets.connect(f"ws://127.0.0.1:{port}/") as ws:
                await ws.send(b"one")
                assert await asyncio.wait_for(ws.recv(), 5) == "got 1"
                await ws.send("two")
                assert await asyncio.wait_for(ws.recv(), 5) == "got 2"
                await ws.send(b"boom")
                with pytest.raises(websockets.ConnectionClosed) as closed:
                    await asyncio.wait_for(ws.recv(), 5)
                assert closed.value.rcvd is not None and closed.value.rcvd.code == 1011
            for _ in range(100):
                if ended:
                    break
                await asyncio.sleep(0.01)
            assert seen == [b"one", "two"]
            assert ended and ended[0]["type"] == "websocket.disconnect"
        finally:
            server.should_exit = True
            await task

    asyncio.run(main())


def test_send_text_now_declines_while_writes_are_paused() -> None:
    async def main() -> None:
        config = uvicorn.Config(_app, ws=BufferedReadsProtocol, log_level="warning")
        config.load()
        proto = BufferedReadsProtocol(config, ServerState(), {})
        transport = _WriteTransport()
        proto.transport = transport  # type: ignore[assignment]
        assert not proto.send_text_now(b"x")  # no handshake yet
        proto.handshake_complete = True
        proto.writable.clear()  # the transport asked to pause writing
        assert not proto.send_text_now(b"x")
        assert transport.writes == []

    asyncio.run(main())
