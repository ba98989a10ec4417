"""The media transports' parts, each alone (pure, no socket, no peer connection): the playout
per item (transports/media_playout.py), Twilio's marks (transports/twilio_marks.py) and what
a Twilio call sends (transports/twilio_out.py), a call's session settings, and the WebRTC
reply track's playout (transports/webrtc_track.py)."""

from __future__ import annotations

import asyncio
import json

import pytest

from duplex_server.protocol import events as ev
from duplex_server.protocol.errors import ProtocolError
from duplex_server.transports.media_playout import MediaPlayout
from duplex_server.transports.twilio import call_session
from duplex_server.transports.twilio_marks import TwilioMarks
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


# ---------------------------------------------------------------------------- MediaPlayout
def test_playout_is_pending_until_the_far_end_played_what_was_sent() -> None:
    p = MediaPlayout()
    assert p.playing() is None and not p.pending
    p.sent(_delta("item_1", 0.0, 100.0))
    p.sent(_delta("item_1", 100.0, 100.0))
    assert p.sent_ms == {"item_1": 200.0} and p.playing() == "resp_1"
    p.played("item_1", 150.0)
    p.played("item_1", 120.0)  # never backwards
    assert p.played_ms["item_1"] == 150.0 and p.pending
    p.played("item_1", 200.0)
    assert p.playing() is None
    p.played("item_unknown", 50.0)  # an item never sent is not tracked
    assert "item_unknown" not in p.played_ms


def test_playout_cut_says_how_far_the_item_was_heard_once() -> None:
    p = MediaPlayout()
    assert p.cut() is None
    p.sent(_delta("item_1", 0.0, 300.0))
    p.sent_through("item_1", 280.0)  # the transport's own count (Twilio: in samples)
    p.played("item_1", 120.6)
    assert p.cut() == ("item_1", 120)
    assert p.cut() is None and p.item is None and not p.sent_ms and not p.played_ms
    p.sent(_delta("item_2", 0.0, 100.0))
    p.played("item_2", 100.0)
    assert p.cut() is None  # all of it heard: nothing to truncate


def test_playout_defers_to_the_transport_queue_when_it_has_one() -> None:
    queued = [True]
    p = MediaPlayout(still_queued=lambda: queued[0])
    p.sent(_delta("item_1", 0.0, 100.0))
    p.played("item_1", 100.0)
    assert p.playing() == "resp_1"  # the track still holds audio
    queued[0] = False
    assert p.playing() is None


# ---------------------------------------------------------------------------- TwilioMarks
def test_marks_name_where_each_chunk_ends_in_samples() -> None:
    m = TwilioMarks()
    # 20 ms of 8 kHz PCM16 is 320 bytes; 10 ms at 24 kHz is 480
    assert m.next("item_1", 320, 8000) == ("item_1:20", 20)
    assert m.next("item_1", 480, 24000) == ("item_1:30", 30)
    assert m.next("item_2", 161, 8000) == ("item_2:10", 10)  # rounded, the sum kept exact
    assert m.sent == 3


def test_an_echoed_mark_hands_back_its_position_unless_its_item_was_cleared() -> None:
    m = TwilioMarks()
    m.hold_position("item_1:20", 640)
    m.hold_position("item_1:40", 0)  # no echo reference: nothing held
    assert m.echo("item_1:20", "item_1") == (True, 640)
    assert m.echo("item_1:40", "item_1") == (True, None)
    m.hold_position("item_1:60", 1280)
    m.clear("item_1")
    assert m.echo("item_1:60", "item_1") == (False, None)  # cleared: never heard
    m.clear(None)
    assert m.echoed == 3 and m.clears == 2


# ---------------------------------------------------------------------------- TwilioOut
class Wire:
    """A Twilio socket that records the text frames sent."""

    def __init__(self) -> None:
        self.sent: list[dict[str, object]] = []

    async def send_text(self, data: str) -> None:
        self.sent.append(json.loads(data))


class Link:
    """What TwilioOut reads of its media link: the playout (and no echo control)."""

    def __init__(self) -> None:
        self.playout = MediaPlayout()
        self.feed = None


def test_twilio_out_sends_media_then_a_mark_and_learns_from_its_echo() -> None:
    async def run() -> None:
        ws, link = Wire(), Link()
        out = TwilioOut(ws, link)  # type: ignore[arg-type]
        out.stream_sid = "MZ1"
        delta = _delta("item_1", 0.0, 20.0)
        link.playout.sent(delta)  # (the link's wire notes the delta before writing it)
        await out.write_audio(delta, b"\x00\x00" * 160, 8000)
        assert [m["event"] for m in ws.sent] == ["media", "mark"]
        assert ws.sent[1] == {"event": "mark", "streamSid": "MZ1", "mark": {"name": "item_1:20"}}
        assert link.playout.playing() == "resp_1"
        out.mark_echoed(Mark(mark=MarkBody("item_1:20")))
        assert link.playout.playing() is None
        with pytest.raises(Malformed):
            out.mark_echoed(Mark(mark=MarkBody("not ours")))
        await out.write_audio(delta, b"\x00\x00" * 160, 8000)
        await out.flush_playout()
        assert ws.sent[-1] == {"event": "clear", "streamSid": "MZ1"}
        out.mark_echoed(Mark(mark=MarkBody("item_1:40")))  # cleared: never heard
        assert link.playout.played_ms["item_1"] == 20.0
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
        self.heard: dict[str, float] = {}

    def emit(self, event: ev.ServerEvent) -> None:
        self.events.append(event)

    def played(self, pcm: bytes) -> None:
        self.frames.append(pcm)

    def audio_played(self, item_id: str, ms: float) -> None:
        self.heard[item_id] = ms


def test_the_reply_track_plays_a_response_then_silence_and_says_so() -> None:
    async def run() -> None:
        listener = Listener()
        track = ReplyTrack(listener)
        frame_bytes = TRACK_FRAME * 2
        pcm = b"\x01\x00" * (TRACK_FRAME * 3 // 2)  # 30 ms at 48 kHz
        track.enqueue(_delta("item_1", 0.0, 30.0), pcm, TRACK_RATE)
        track.finish("resp_1")
        assert track.has_queued()
        track._start = -1e9  # (pacing off: every frame is due)
        track._pts = 1
        await track.recv()
        await track.recv()
        types = [type(e) for e in listener.events]
        assert types == [ev.OutputAudioStarted, ev.OutputAudioStopped]
        assert listener.heard["item_1"] == pytest.approx(30.0)
        assert not track.has_queued()
        assert [len(f) for f in listener.frames] == [frame_bytes, frame_bytes]
        assert listener.frames[1][frame_bytes // 2 :] == b"\x00" * (frame_bytes // 2)
        track.stop()

    asyncio.run(run())


def test_a_flushed_track_drops_what_was_not_played() -> None:
    async def run() -> None:
        track = ReplyTrack(Listener())
        track.enqueue(_delta("item_1", 0.0, 20.0), b"\x00\x01" * TRACK_FRAME, TRACK_RATE)
        assert track.flush() and not track.has_queued() and track.playing is None
        assert not track.flush()
        track.stop()

    asyncio.run(run())
