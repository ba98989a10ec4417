"""The media transports' parts, each alone (pure, no socket, no peer connection): the media
wire (transports/media.py: the PCM it is handed goes to the media, a cleared buffer is
flushed and reported), Twilio's marks (transports/twilio_marks.py) and what a Twilio call
sends and reports (transports/twilio_out.py), a call's session settings, and the WebRTC
reply track's playout (transports/webrtc_track.py)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from duplex_server.ops.metrics import Metrics
from duplex_server.protocol import events as ev
from duplex_server.protocol.errors import ProtocolError
from duplex_server.protocol.playout import Flushed, Played, PlayoutReport, Queued
from duplex_server.session.attach import Outgoing
from duplex_server.transports.media import MediaWire
from duplex_server.transports.twilio import call_session
from duplex_server.transports.twilio_marks import MarkEcho, TwilioMarks
from duplex_server.transports.twilio_out import TwilioOut
from duplex_server.transports.twilio_wire import Malformed, Mark, MarkBody
from duplex_server.transports.webrtc_track import TRACK_FRAME, TRACK_RATE, ReplyTrack


def _delta(item: str, start: float, ms: float, response: str = "resp_1") -> ev.AudioDelta:
    return ev.AudioDelta(
        response_id=response,
        item_id=item,
        delta="",
        epoch=1,
        audio_start_ms=start,
        duration_ms=ms,
    )


# ---------------------------------------------------------------------------- MediaWire
class Reports:
    """A media link as its wire and its transport see it: the playout reports it passes
    on to the session core (recorded), no echo control, the writer's closing reason."""

    def __init__(self) -> None:
        self.feed = None
        self.reports: list[PlayoutReport] = []
        self.writer = SimpleNamespace(closing=None)

    def report(self, report: PlayoutReport) -> None:
        self.reports.append(report)

    def audio_queued(self, item_id: str) -> None:
        self.report(Queued(item_id))

    def audio_played(self, item_id: str, ms: float, queued_ms: float) -> None:
        self.report(Played(item_id, ms, queued_ms))


class Out:
    """A media transport's sending side, recorded."""

    def __init__(self) -> None:
        self.written: list[tuple[str, object]] = []

    async def write_audio(self, event: ev.AudioDelta, pcm: bytes, rate: int) -> None:
        self.written.append(("audio", (event.item_id, pcm, rate)))

    async def write_event(self, event: ev.ServerEvent, data: bytes) -> None:
        self.written.append(("event", type(event).__name__))

    async def write_raw(self, data: bytes) -> None:
        self.written.append(("raw", data))

    async def hang_up(self, code: int, reason: str) -> None:
        self.written.append(("hang_up", (code, reason)))

    async def flush_playout(self) -> None:
        self.written.append(("flush", None))

    def audio_done(self, response_id: str) -> None:
        self.written.append(("done", response_id))


class WireSession:
    """What a media wire reads of its live session: the epoch, the output rate, stamping."""

    def __init__(self, epoch: int) -> None:
        config = SimpleNamespace(output_format=SimpleNamespace(rate=8000))
        self.core = SimpleNamespace(epoch=epoch, config=config)
        self.metrics = Metrics(lambda: None)

    def next_frame(self, item: Outgoing) -> bytes:
        return b"{}"


def test_the_media_wire_plays_the_pcm_it_is_handed_and_decodes_nothing() -> None:
    async def run() -> None:
        link, out = Reports(), Out()
        wire = MediaWire(link, out)  # type: ignore[arg-type]
        session = WireSession(epoch=2)
        delta = _delta("item_1", 0.0, 20.0)  # its base64 is empty: only the PCM plays
        pcm = b"\x01\x00" * 160
        audio = Outgoing(delta, None, 10, 2, pcm=pcm)
        assert await wire.deliver(audio, session)  # type: ignore[arg-type]
        assert out.written == [("audio", ("item_1", pcm, 8000))]
        stale = Outgoing(delta, None, 10, 1, pcm=pcm)  # a cancelled epoch's audio
        assert not await wire.deliver(stale, session)  # type: ignore[arg-type]
        done = Outgoing(ev.AudioDone(response_id="resp_1", item_id="item_1"), None, 10)
        assert await wire.deliver(done, session)  # type: ignore[arg-type]
        assert out.written[-2:] == [("event", "AudioDone"), ("done", "resp_1")]
        assert link.reports == []  # the transport reports what it hands its far end

    asyncio.run(run())


def test_a_cleared_buffer_flushes_the_far_end_and_reports_it_to_the_core() -> None:
    async def run() -> None:
        link, out = Reports(), Out()
        wire = MediaWire(link, out)  # type: ignore[arg-type]
        cleared = Outgoing(ev.OutputAudioCleared(response_id="resp_1"), None, 10)
        assert await wire.deliver(cleared, WireSession(epoch=0))  # type: ignore[arg-type]
        assert out.written == [("event", "OutputAudioCleared"), ("flush", None)]
        assert link.reports == [Flushed()]  # the core truncates; no client JSON is forged
        assert await wire.deliver(Outgoing(None, b"raw", 3), None) is False
        await wire.stalled()
        assert out.written[-2:] == [("raw", b"raw"), ("hang_up", (1008, "client_too_slow"))]

    asyncio.run(run())


# ---------------------------------------------------------------------------- TwilioMarks
def test_marks_name_where_each_chunk_ends_in_samples() -> None:
    m = TwilioMarks()
    # 20 ms of 8 kHz PCM16 is 320 bytes; 10 ms at 24 kHz is 480
    assert m.next("item_1", 320, 8000) == "item_1:20"
    assert m.next("item_1", 480, 24000) == "item_1:30"
    assert m.item == "item_1"
    assert m.next("item_2", 161, 8000) == "item_2:10"  # rounded, the sum kept exact
    assert m.sent == 3 and m.item == "item_2"


def test_an_echoed_mark_says_what_played_and_what_is_still_held() -> None:
    m = TwilioMarks()
    for _ in range(3):
        m.next("item_1", 320, 8000)  # 60 ms sent
    m.hold_position("item_1:20", 640)
    m.hold_position("item_1:40", 0)  # no echo reference: nothing held
    assert m.echo("item_1:20", "item_1", 20.0) == MarkEcho("item_1", 20.0, 40.0, 640)
    assert m.echo("item_1:40", "item_1", 40.0) == MarkEcho("item_1", 40.0, 20.0, None)
    assert m.echo("item_1:60", "item_1", 60.0) == MarkEcho("item_1", 60.0, 0.0, None)


def test_a_clear_makes_the_late_marks_of_the_item_sent_last_unheard() -> None:
    m = TwilioMarks()
    m.next("item_1", 320, 8000)
    m.hold_position("item_1:20", 1280)
    m.clear()
    assert m.item is None
    assert m.echo("item_1:20", "item_1", 20.0) is None  # cleared: never heard
    m.clear()  # nothing sent since: nothing more to ignore
    m.next("item_2", 320, 8000)
    assert m.echo("item_2:20", "item_2", 20.0) == MarkEcho("item_2", 20.0, 0.0, None)
    assert m.echoed == 2 and m.clears == 2


# ---------------------------------------------------------------------------- TwilioOut
class Wire:
    """A Twilio socket that records the text frames sent."""

    def __init__(self) -> None:
        self.sent: list[dict[str, object]] = []

    async def send_text(self, data: str) -> None:
        self.sent.append(json.loads(data))


def test_twilio_out_sends_media_then_a_mark_and_reports_what_its_echo_says() -> None:
    async def run() -> None:
        ws, link = Wire(), Reports()
        out = TwilioOut(ws, link)  # type: ignore[arg-type]
        out.stream_sid = "MZ1"
        delta = _delta("item_1", 0.0, 20.0)
        await out.write_audio(delta, b"\x00\x00" * 160, 8000)
        assert [m["event"] for m in ws.sent] == ["media", "mark"]
        assert ws.sent[1] == {"event": "mark", "streamSid": "MZ1", "mark": {"name": "item_1:20"}}
        await out.write_audio(delta, b"\x00\x00" * 160, 8000)
        assert link.reports == [Queued("item_1"), Queued("item_1")]
        out.mark_echoed(Mark(mark=MarkBody("item_1:20")))
        assert link.reports[-1] == Played("item_1", 20.0, 20.0)  # 20 ms more still queued
        with pytest.raises(Malformed):
            out.mark_echoed(Mark(mark=MarkBody("not ours")))
        await out.flush_playout()
        assert ws.sent[-1] == {"event": "clear", "streamSid": "MZ1"}
        out.mark_echoed(Mark(mark=MarkBody("item_1:40")))  # cleared: never heard
        assert len(link.reports) == 3
        assert (out.marks.sent, out.marks.echoed, out.marks.clears) == (
            2,
            2,
            1,
        )  # (not ours: not counted)

    asyncio.run(run())


# ---------------------------------------------------------------------------- call settings
def test_call_session_puts_the_transport_formats_over_the_callers_settings() -> None:
    patch = call_session({})
    assert patch["audio"]["input"]["echo_cancellation"] is True
    assert patch["audio"]["output"]["format"] == {"type": "audio/pcmu"}
    user = {"instructions": "hi", "audio": {"input": {"echo_cancellation": False}}}
    patch = call_session({"session": json.dumps(user)})
    assert patch["instructions"] == "hi"
    assert patch["audio"]["input"]["echo_cancellation"] is False
    assert patch["audio"]["input"]["format"] == {"type": "audio/pcm", "rate": 16000}
    with pytest.raises(ProtocolError):
        call_session({"session": "[1]"})
    with pytest.raises(json.JSONDecodeError):
        call_session({"session": "{"})


# ---------------------------------------------------------------------------- ReplyTrack
class Listener:
    """The call a reply track plays for: what it was told."""

    def __init__(self) -> None:
        self.events: list[ev.ServerEvent] = []
        self.frames: list[bytes] = []
        self.heard: dict[str, tuple[float, float]] = {}

    def emit(self, event: ev.ServerEvent) -> None:
        self.events.append(event)

    def played(self, pcm: bytes) -> None:
        self.frames.append(pcm)

    def audio_played(self, item_id: str, ms: float, queued_ms: float) -> None:
        self.heard[item_id] = (ms, queued_ms)


def test_the_reply_track_plays_a_response_then_silence_and_says_so() -> None:
    async def run() -> None:
        listener = Listener()
        track = ReplyTrack(listener)
        frame_bytes = TRACK_FRAME * 2
        pcm = b"\x01\x00" * (TRACK_FRAME * 3 // 2)  # 30 ms at 48 kHz
        assert track.enqueue(_delta("item_1", 0.0, 30.0), pcm, TRACK_RATE)
        track.finish("resp_1")
        assert track.queued_bytes == len(pcm)
        track._start = -1e9  # (pacing off: every frame is due)
        track._pts = 1
        await track.recv()
        await track.recv()
        types = [type(e) for e in listener.events]
        assert types == [ev.OutputAudioStarted, ev.OutputAudioStopped]
        assert listener.heard["item_1"] == pytest.approx((30.0, 0.0))
        assert track.queued_bytes == 0 and not track.queue
        assert [len(f) for f in listener.frames] == [frame_bytes, frame_bytes]
        assert listener.frames[1][frame_bytes // 2 :] == b"\x00" * (frame_bytes // 2)
        track.stop()

    asyncio.run(run())


def test_a_flushed_track_drops_what_was_not_played() -> None:
    async def run() -> None:
        track = ReplyTrack(Listener())
        track.enqueue(_delta("item_1", 0.0, 20.0), b"\x00\x01" * TRACK_FRAME, TRACK_RATE)
        assert track.flush() and track.queued_bytes == 0 and track.playing is None
        assert not track.flush()
        track.stop()

    asyncio.run(run())
