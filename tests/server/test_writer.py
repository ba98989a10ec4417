"""The one writer every transport holds (duplex_server/session/writer.py): order, close after
the queue drains, back-pressure, a takeover, and the slow-client policy driven by the hub's real
send watchdog; then the WebSocket and the media transports on the same writer."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec
import pytest

from duplex_server.config import load_app_config
from duplex_server.ops.metrics import Metrics
from duplex_server.protocol import events as ev
from duplex_server.session.attach import Outgoing
from duplex_server.session.hub import Hub
from duplex_server.session.live import LiveSession
from duplex_server.session.writer import QueuedWriter
from duplex_server.transports.realtime import SocketTransport
from duplex_server.transports.twilio import TwilioCall

ROOT = Path(__file__).resolve().parents[2]


def _hub(pool: ThreadPoolExecutor, **server: Any) -> Hub:
    config = load_app_config(ROOT / "configs" / "test.yaml")
    config = msgspec.structs.replace(
        config, server=msgspec.structs.replace(config.server, **server)
    )
    return Hub(config, Metrics(lambda: None), pool)


class FakeSession:
    """What the writer asks of a live session: stamping, ``sent`` and ``too_slow``."""

    def __init__(self, writer: QueuedWriter) -> None:
        self.writer = writer
        self.sent_items: list[Outgoing] = []
        self.too_slow_calls = 0

    def next_frame(self, item: Outgoing) -> bytes | None:
        if item.raw is not None:
            return item.raw
        if item.epoch is not None and item.epoch < 1:
            return None  # stale
        return b"stamped:" + type(item.event).__name__.encode()

    def sent(self, item: Outgoing) -> None:
        self.sent_items.append(item)

    def too_slow(self) -> None:
        self.too_slow_calls += 1
        self.writer.close(1008, "client_too_slow")


class Recorder:
    """A transport's wire that records what reaches it; ``block`` holds a delivery."""

    def __init__(self, hub: Hub, *, announce_replaced: bool = True) -> None:
        self.writer = QueuedWriter(hub, announce_replaced=announce_replaced)
        self.wire: list[bytes] = []
        self.finished: tuple[int, str] | None = None
        self.stall_hook = 0
        self.done_hook = 0
        self.block: asyncio.Event | None = None
        self.since_seen: list[float | None] = []

    async def deliver(self, item: Outgoing, session: LiveSession | None) -> bool:
        self.since_seen.append(self.writer.send_since)
        if self.block is not None:
            await self.block.wait()
        data = item.raw if session is None else session.next_frame(item)
        if data is None:
            return False
        self.wire.append(data)
        return True

    async def finish(self, code: int, reason: str) -> None:
        self.finished = (code, reason)

    async def stalled(self) -> None:
        self.stall_hook += 1

    def writer_done(self) -> None:
        self.done_hook += 1


def _event(size: int = 10, epoch: int | None = None) -> Outgoing:
    return Outgoing(ev.InputCleared(), None, size, epoch=epoch)


def test_delivers_in_order_marks_events_sent_and_closes_after_the_queue_drains() -> None:
    async def run() -> None:
        with ThreadPoolExecutor(1) as pool:
            r = Recorder(_hub(pool))
            w = r.writer
            session = FakeSession(w)
            w.session = session  # type: ignore[assignment]
            task = asyncio.create_task(w.run(r))
            w.send_stamped(b"replayed")
            assert w.send_event(_event())
            assert w.send_event(_event(epoch=0))  # stale: not written, not "sent"
            w.close(1001, "going away")
            assert w.send_event(_event())  # queued before the close is carried out
            await asyncio.wait_for(task, 2)
            stamped = b"stamped:InputCleared"
            assert r.wire == [b"replayed", stamped, stamped]
            assert len(session.sent_items) == 2  # events written; not the raw, not stale
            assert r.finished == (1001, "going away")
            assert r.done_hook == 1 and r.stall_hook == 0
            assert all(s is not None for s in r.since_seen) and w.send_since is None
            assert w.queued_bytes == 0

    asyncio.run(run())


def test_close_without_a_code_finishes_normally_and_an_unattached_event_is_dropped() -> None:
    async def run() -> None:
        with ThreadPoolExecutor(1) as pool:
            r = Recorder(_hub(pool))
            w = r.writer
            task = asyncio.create_task(w.run(r))
            assert w.send_event(_event())  # no session attached: nothing to stamp it
            w.send_stamped(b"error before a session")
            await asyncio.sleep(0.05)
            assert r.finished is None and not task.done()  # an empty queue waits
            w.close(1000, "")
            await asyncio.wait_for(task, 2)
            assert r.wire == [b"error before a session"]
            assert r.finished == (1000, "")

    asyncio.run(run())


def test_back_pressure_refuses_over_budget_unless_closing() -> None:
    async def run() -> None:
        with ThreadPoolExecutor(1) as pool:
            w = Recorder(_hub(pool, output_buffer_bytes=100)).writer
            assert w.send_event(_event(size=60))
            assert w.send_event(_event(size=40))
            assert w.queued_bytes == 100
            assert not w.send_event(_event(size=1))  # over the budget: a slow client
            w.close(1000, "bye")
            assert w.send_event(_event(size=1))  # closing: dropped, not a slow client
            assert w.queued_bytes == 100
            assert w.purge_audio(1) == 0
            assert len(w.take_unsent()) == 2 and w.queued_bytes == 0

    asyncio.run(run())


@pytest.mark.parametrize("announce", [True, False])
def test_replaced_drops_the_queue_forgets_the_session_and_closes(announce: bool) -> None:
    """A takeover: the socket transport sends session.replaced; a media transport closes
    silently. Either way the session is forgotten and what was queued never goes out."""

    async def run() -> None:
        with ThreadPoolExecutor(1) as pool:
            r = Recorder(_hub(pool), announce_replaced=announce)
            w = r.writer
            w.session = FakeSession(w)  # type: ignore[assignment]
            assert w.send_event(_event())
            w.replaced(b"replaced")
            assert w.session is None and w.closing == (1000, "replaced")
            await asyncio.wait_for(w.run(r), 2)
            assert r.wire == ([b"replaced"] if announce else [])
            assert r.finished == (1000, "replaced")

    asyncio.run(run())


def test_a_send_past_send_timeout_is_a_slow_client_caught_by_the_hub_watchdog() -> None:
    async def run() -> None:
        with ThreadPoolExecutor(1) as pool:
            hub = _hub(pool, send_timeout_s=0.2)
            r = Recorder(hub)
            w = r.writer
            session = FakeSession(w)
            w.session = session  # type: ignore[assignment]
            hub.sockets.add(w)
            r.block = asyncio.Event()  # the client never reads
            task = asyncio.create_task(w.run(r))
            w.send_event(_event())
            await asyncio.wait_for(task, 3)
            assert not task.cancelled()  # the watchdog's cancel is absorbed, not propagated
            assert session.too_slow_calls == 1 and r.stall_hook == 1 and r.done_hook == 1
            assert w.closing == (1008, "client_too_slow")
            assert r.wire == [] and r.finished is None and w.send_since is None
            hub.sockets.discard(w)

    asyncio.run(run())


def test_a_cancel_that_is_not_the_watchdog_propagates() -> None:
    async def run() -> None:
        with ThreadPoolExecutor(1) as pool:
            r = Recorder(_hub(pool))
            w = r.writer
            session = FakeSession(w)
            w.session = session  # type: ignore[assignment]
            task = asyncio.create_task(w.run(r))
            await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert session.too_slow_calls == 0 and r.stall_hook == 0 and r.done_hook == 1

    asyncio.run(run())


class StuckSocket:
    """A WebSocket whose peer never reads: ``send_text`` never returns."""

    def __init__(self) -> None:
        self.scope: dict[str, Any] = {"type": "websocket"}  # no server extensions
        self.closed: tuple[int, str] | None = None
        self._gone = asyncio.Event()

    async def send_text(self, data: str | bytes) -> None:
        await asyncio.Event().wait()

    async def receive(self) -> dict[str, Any]:
        await self._gone.wait()  # nothing comes in until the socket is closed
        return {"type": "websocket.disconnect", "code": 1006}

    async def close(self, code: int = 1000, reason: str = "") -> None:
        self.closed = self.closed or (code, reason)
        self._gone.set()


@pytest.mark.parametrize("transport", [SocketTransport, TwilioCall])
def test_every_transport_runs_the_shared_writer_and_its_slow_client_policy(
    transport: type[SocketTransport] | type[TwilioCall],
) -> None:
    """A stuck peer: the socket transport's serve() and Twilio's both end (the reader
    stopped too), the session hears too_slow once; Twilio hangs up with 1008."""

    async def run() -> None:
        with ThreadPoolExecutor(1) as pool:
            hub = _hub(pool, send_timeout_s=0.2)
            ws = StuckSocket()
            att = transport(hub, ws)  # type: ignore[arg-type]
            w = att.link.writer if isinstance(att, TwilioCall) else att.writer
            assert isinstance(w, QueuedWriter)
            session = FakeSession(w)
            w.session = session  # type: ignore[assignment]
            hub.sockets.add(w)
            w.send_stamped(b'{"type":"error"}')
            if isinstance(att, TwilioCall):
                # a media transport writes raw bytes without the wire (a log line); its
                # audio is what blocks on a stuck peer
                att.out.write_raw = ws.send_text  # type: ignore[method-assign,assignment]
            await asyncio.wait_for(att.serve(), 3)
            assert session.too_slow_calls == 1
            if isinstance(att, TwilioCall):
                assert ws.closed == (1008, "client_too_slow")
            hub.sockets.discard(w)

    asyncio.run(run())
