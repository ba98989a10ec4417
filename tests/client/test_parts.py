"""The SDK client's parts, each alone: the event stream and the resend buffer (pure), and the
connection against a scripted WebSocket server on loopback (open, refusal, drop, resume
with a replay and the input the server lacks)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import pytest
import websockets
from duplex_client import events as ev
from duplex_client.connection import Connection, ResumePolicy
from duplex_client.errors import ConnectionLost, SessionRefused
from duplex_client.resend import InputLog
from duplex_client.stream import EventStream, ends_session
from duplex_client.wire import decode_event, encode_event
from websockets.asyncio.server import ServerConnection

from duplex_server.protocol.session_config import EffectiveSession
from tests.server.harness import UNIT

CAPS = ev.Capabilities(
    supports_barge_in=True,
    supports_session_resume=True,
    input_audio_formats=["audio/pcm"],
    output_audio_formats=["audio/pcm"],
    turn_detection=["server_vad"],
    vad_backend="energy",
    max_frame_bytes=1 << 20,
    journal_max_bytes=1 << 20,
    journal_max_age_s=30.0,
)


def _created(seq: int = 1) -> ev.SessionCreated:
    return ev.SessionCreated(
        session=EffectiveSession().to_wire("sess_t"),
        resume_token="tok1",
        capabilities=CAPS,
        server_event_seq=seq,
    )


def _ack(seq: int) -> ev.HeartbeatAck:
    return ev.HeartbeatAck(server_event_seq=seq)


def encode(event: ev.ServerEvent) -> str:
    return msgspec.json.encode(event).decode()


# ---------------------------------------------------------------- the event stream (pure)


def test_the_stream_drops_what_it_delivered_and_keeps_the_session() -> None:
    async def main() -> None:
        stream = EventStream()
        stream.deliver(_created(1))
        for seq in (2, 3, 2, 3, 4):  # a replay after a drop repeats 2 and 3
            stream.deliver(_ack(seq))
        stream.deliver(_ack(0))  # events without a seq always pass
        assert (stream.last_seq, stream.duplicates_dropped) == (4, 2)
        assert stream.session is not None and stream.session.id == "sess_t"
        got = [await stream.next(1.0) for _ in range(5)]
        assert [e.server_event_seq for e in got if e] == [1, 2, 3, 4, 0]
        stream.skip_to(9)  # session.resumed took seq 9: not shown
        stream.deliver(_ack(9))
        assert stream.duplicates_dropped == 3 and not stream.ended

    asyncio.run(main())


def test_a_session_goes_on_after_an_engine_restart_but_not_after_other_resyncs() -> None:
    stream = EventStream()
    restarted = ev.ResyncRequired(reason="engine_restarted", first_available_seq=4, last_seq=3)
    assert not ends_session(restarted)
    stream.deliver(msgspec.structs.replace(restarted, server_event_seq=4))
    assert not stream.ended
    journal = ev.ResyncRequired(reason="journal", first_available_seq=9, last_seq=12)
    assert ends_session(journal)


def test_the_stream_ends_after_a_terminal_event_and_stays_ended() -> None:
    async def main() -> None:
        stream = EventStream()
        lost = ev.ResyncRequired(reason="front_end_lost", first_available_seq=1, last_seq=2)
        assert not ends_session(lost)
        stream.deliver(ev.SessionClosed(reason="client", server_event_seq=5))
        assert stream.ended
        await stream.wait_ended(0.0)  # at once
        assert isinstance(await stream.next(1.0), ev.SessionClosed)
        assert await stream.next(1.0) is None
        assert await stream.next(1.0) is None  # the end stays visible
        assert [e async for e in stream.events()] == []

    asyncio.run(main())


def test_a_lost_stream_raises_its_error_after_the_events_before_it() -> None:
    async def main() -> None:
        stream = EventStream()
        stream.deliver(_ack(1))
        stream.fail(ConnectionLost("gone"))
        assert stream.ended
        got: list[ev.AnyServerEvent] = []
        with pytest.raises(ConnectionLost):
            async for event in stream.events():
                got.append(event)
        assert [e.server_event_seq for e in got] == [1]

    asyncio.run(main())


# ---------------------------------------------------------------- the resend buffer (pure)


def test_the_resend_buffer_sends_what_the_server_lacks_in_order() -> None:
    async def main() -> None:
        log = InputLog()
        for data in (b"a", "b", b"c"):
            log.add(log.next_seq(), data)
        sent: list[str | bytes] = []

        async def send(data: str | bytes) -> None:
            sent.append(data)

        await log.resend(send, None)  # a server without input numbering: nothing
        assert sent == [] and log.resent == 0
        await log.resend(send, 1)
        assert sent == ["b", b"c"] and (log.resent, log.resent_upto) == (2, 3)
        assert log.sent_by_resume(3) and not log.sent_by_resume(4)
        await log.resend(send, 3)  # the server has everything now
        assert sent == ["b", b"c"] and log.after(3) == []

    asyncio.run(main())


def test_the_wire_round_trips_a_client_event() -> None:
    text = encode_event(ev.SessionEventAck(seq=7))
    assert json.loads(text) == {"type": "session.event_ack", "seq": 7, "event_id": None}
    assert isinstance(decode_event('{"type": "session.heartbeat_ack"}'), ev.HeartbeatAck)


# ---------------------------------------------------------------- the connection (loopback)

Handler = Callable[[ServerConnection, int], Awaitable[None]]


async def _serve(handler: Handler) -> tuple[str, list[str], Any]:
    """A scripted server: ``handler(ws, n)`` for the n-th connection (0 first)."""
    paths: list[str] = []

    async def handle(ws: ServerConnection) -> None:
        assert ws.request is not None
        paths.append(ws.request.path)
        await handler(ws, len(paths) - 1)

    server = await websockets.serve(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return f"ws://127.0.0.1:{port}/v1/realtime", paths, server


def _connection(url: str, stream: EventStream, inputs: InputLog) -> Connection:
    policy = ResumePolicy(attempts=2, backoff_s=0.01)
    return Connection(url, {}, stream=stream, inputs=inputs, policy=policy)


def test_a_refusal_before_session_created_is_raised_with_its_code() -> None:
    async def refuse(ws: ServerConnection, n: int) -> None:
        detail = ev.ErrorDetail(type="invalid_request_error", code="unauthorized", message="no")
        await ws.send(encode(ev.Error(error=detail)))
        await ws.wait_closed()

    async def main() -> None:
        url, _, server = await _serve(refuse)
        async with server:
            conn = _connection(url, EventStream(), InputLog())
            with pytest.raises(SessionRefused) as info:
                await conn.open_session(5 * UNIT)
            assert info.value.code == "unauthorized"

    asyncio.run(main())


def test_a_dropped_socket_is_resumed_with_the_replay_and_the_missing_input() -> None:
    got: list[list[str | bytes]] = [[], []]

    async def script(ws: ServerConnection, n: int) -> None:
        if n == 0:
            await ws.send(encode(_created(1)))
            await ws.send(encode(_ack(2)))
            got[0].append(await ws.recv())  # input 1 arrives; input 2 is "lost"
            await ws.close()
            return
        resume = json.loads(await ws.recv())
        got[1].append(resume["type"])
        assert resume["last_received_server_event_seq"] == 2
        assert resume["resume_token"] == "tok1"
        await ws.send(encode(_ack(2)))  # replayed, already delivered
        await ws.send(encode(_ack(3)))
        resumed = ev.SessionResumed(
            session_id="sess_t",
            resume_token="tok2",
            replayed=2,
            lease_generation=2,
            last_input_seq=1,
            server_event_seq=4,
        )
        await ws.send(encode(resumed))
        async for data in ws:
            got[1].append(data)
            if isinstance(data, str) and json.loads(data)["type"] == "session.close":
                await ws.send(encode(ev.SessionClosed(reason="client", server_event_seq=5)))

    async def main() -> None:
        url, paths, server = await _serve(script)
        async with server:
            stream, inputs = EventStream(), InputLog()
            conn = _connection(url, stream, inputs)
            created = await conn.open_session(5 * UNIT)
            stream.deliver(created)
            await conn.send(b"one", inputs.next_seq())
            inputs.add(inputs.next_seq(), b"two")  # sent into the drop
            conn.start(heartbeat_s=60.0)
            seqs = [(await stream.next(5 * UNIT)) for _ in range(3)]
            assert [e.server_event_seq for e in seqs if e] == [1, 2, 3]
            await conn.send(b"three", inputs.next_seq())  # waits for the resumed socket
            assert conn.resumes == 1 and conn.resume_token == "tok2"
            assert (stream.duplicates_dropped, stream.last_seq) == (1, 4)
            assert paths == ["/v1/realtime", "/v1/realtime?intent=resume"]
            await conn.close()
            assert got[0] == [b"one"]
            # "three" waited for the new socket: the resume sent it, or its own send did,
            # never both
            assert got[1][:3] == ["session.resume", b"two", b"three"]
            assert json.loads(got[1][3])["type"] == "session.close" and len(got[1]) == 4
            assert inputs.resent in (1, 2)

    asyncio.run(main())


def test_a_resume_the_server_refuses_ends_the_stream_with_connection_lost() -> None:
    async def script(ws: ServerConnection, n: int) -> None:
        if n == 0:
            await ws.send(encode(_created(1)))
            await ws.close()
            return
        await ws.recv()
        await ws.send(encode(ev.SessionExpired(reason="lease", server_event_seq=2)))
        await ws.wait_closed()

    async def main() -> None:
        url, _, server = await _serve(script)
        async with server:
            stream = EventStream()
            conn = _connection(url, stream, InputLog())
            stream.deliver(await conn.open_session(5 * UNIT))
            conn.start(heartbeat_s=60.0)
            events = [(await stream.next(5 * UNIT)) for _ in range(2)]
            assert isinstance(events[1], ev.SessionExpired)
            assert stream.ended and conn.resumes == 0
            with pytest.raises(ConnectionLost):
                await conn.send("{}")
            await conn.close()

    asyncio.run(main())
