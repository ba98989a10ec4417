"""A media transport's playout reports, without a peer: the WebRTC reply track says what it
was handed, what it played of each item and what it still holds (the session core's
playout state, duplex_server/protocol/playout.py, is built from these)."""

from __future__ import annotations

from duplex_server.protocol import events as ev
from duplex_server.transports.webrtc_track import TRACK_FRAME, ReplyTrack


class FakeCall:
    """The track's side of a WebRTC attachment: it only records what it is told."""

    def __init__(self) -> None:
        self.played_reports: list[tuple[str, float, float]] = []
        self.events: list[ev.ServerEvent] = []

    def audio_played(self, item_id: str, ms: float, queued_ms: float) -> None:
        self.played_reports.append((item_id, ms, queued_ms))

    def emit(self, event: ev.ServerEvent) -> None:
        self.events.append(event)

    def played(self, pcm: bytes) -> None:
        pass


def _delta(item: str, start_ms: float, duration_ms: float) -> ev.AudioDelta:
    return ev.AudioDelta(
        response_id="resp_" + item,
        item_id="item_" + item,
        delta="",
        epoch=0,
        audio_start_ms=start_ms,
        duration_ms=duration_ms,
    )


def test_the_reply_track_reports_what_it_played_and_what_it_holds() -> None:
    call = FakeCall()
    track = ReplyTrack(call)
    assert track.enqueue(_delta("a", 0.0, 30.0), b"\x01\x00" * 1440, 48000)  # 30 ms
    assert track.enqueue(_delta("b", 0.0, 10.0), b"\x01\x00" * 480, 48000)  # 10 ms
    frame = TRACK_FRAME * 2  # 20 ms
    track._take(frame)
    assert call.played_reports == [("item_a", 20.0, 20.0)]
    track._take(frame)  # the rest of a, then all of b
    assert call.played_reports[1:] == [("item_a", 30.0, 10.0), ("item_b", 10.0, 0.0)]
    assert track.queued_bytes == 0
    assert [type(e) for e in call.events] == [ev.OutputAudioStarted, ev.OutputAudioStarted]


def test_audio_the_resampler_holds_back_is_not_queued_and_a_flush_empties_the_track() -> None:
    call = FakeCall()
    track = ReplyTrack(call)
    assert not track.enqueue(_delta("a", 0.0, 0.1), b"\x01\x00" * 2, 24000)  # nothing out yet
    assert track.enqueue(_delta("b", 0.0, 20.0), b"\x01\x00" * 960, 48000)
    assert track.flush() and track.queued_bytes == 0
    track._take(TRACK_FRAME * 2)
    assert call.played_reports == []  # silence: nothing played, nothing reported
