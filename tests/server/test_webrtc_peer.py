"""The WebRTC peer's microphone path: the jitter buffer releases each of the caller's audio
packets as it comes, not 4 packets later nor when the next one comes, and a lost packet
never holds back the ones after it (duplex_server/transports/webrtc_peer.py: the server reads
frames as they come, so aiortc's player cushion was ~80 ms on every barge-in and every turn
end, and after one lost packet ~300 ms for the rest of the call)."""

from __future__ import annotations

import asyncio

from aiortc import RTCPeerConnection
from aiortc.jitterbuffer import JitterBuffer
from aiortc.mediastreams import AudioStreamTrack
from aiortc.rtp import RtpPacket

from duplex_server.transports.webrtc_peer import AudioJitterBuffer, WebRtcPeer

#: where aiortc 1.16's RTCRtpReceiver keeps its jitter buffer
JITTER_ATTR = "_RTCRtpReceiver__jitter_buffer"
OPUS_FRAME = 960  # RTP timestamp units per 20 ms packet at 48 kHz


class Listener:
    def receive_message(self, message: str | bytes) -> None:
        pass

    def receive_mic(self, pcm: bytes, rate: int) -> None:
        pass


def packet(seq: int) -> RtpPacket:
    out = RtpPacket(
        payload_type=111, sequence_number=seq, timestamp=seq * OPUS_FRAME, payload=b"\xfc"
    )
    out._data = out.payload  # type: ignore[attr-defined]  # (the receiver sets it: the payload)
    return out


def released(buffer: JitterBuffer, seqs: list[int]) -> list[int | None]:
    """For each packet added in turn, the timestamp's packet number of the frame it lets go
    (None: none yet)."""
    out: list[int | None] = []
    for seq in seqs:
        _, frame = buffer.add(packet(seq))
        out.append(None if frame is None else frame.timestamp // OPUS_FRAME)
    return out


def test_the_callers_audio_leaves_the_jitter_buffer_as_its_packet_comes() -> None:
    async def answer() -> JitterBuffer:
        caller = RTCPeerConnection()
        peer = WebRtcPeer(Listener(), AudioStreamTrack(), ice_servers=[])
        try:
            caller.addTransceiver("audio", direction="sendrecv")
            caller.createDataChannel("oai-events")
            await caller.setLocalDescription(await caller.createOffer())
            await peer.answer(caller.localDescription.sdp)
            receiver = next(t for t in peer.pc.getTransceivers() if t.kind == "audio").receiver
            buffer = getattr(receiver, JITTER_ATTR)
            assert isinstance(buffer, JitterBuffer)
            return buffer
        finally:
            await peer.close()
            await caller.close()

    buffer = asyncio.run(answer())
    assert isinstance(buffer, AudioJitterBuffer)
    # each packet is a whole Opus frame: it leaves as it comes; aiortc's own buffer waits for
    # the next packet (prefetch 1) or for 4 more (its default)
    assert released(buffer, [1, 2, 3, 4]) == [1, 2, 3, 4]
    assert released(JitterBuffer(capacity=16, prefetch=1), [1, 2, 3, 4]) == [None, 1, 2, 3]
    assert released(JitterBuffer(capacity=16, prefetch=4), [1, 2, 3, 4, 5]) == [
        None,
        None,
        None,
        None,
        1,
    ]


def test_a_lost_packet_never_holds_back_the_callers_later_audio() -> None:
    """aiortc's buffer waits for a missing packet until it is full, then lets one frame go
    per packet: after one loss every later frame stays ~15 packets late. Here a gap is
    skipped and a packet that comes after a later one is dropped, as lost."""
    stock = JitterBuffer(capacity=16, prefetch=1)
    seqs = [1, 2, 3, *range(5, 40)]  # packet 4 lost
    lag = [s - f for s, f in zip(seqs, released(stock, seqs), strict=True) if f is not None]
    assert lag[-1] == 14  # (aiortc's: for the rest of the call)

    lean = AudioJitterBuffer()
    assert released(lean, seqs) == seqs
    assert (lean.skipped, lean.late) == (1, 0)
    lean = AudioJitterBuffer()
    assert released(lean, [10, 12, 11, 13, 13, 14]) == [10, 12, None, 13, None, 14]
    assert (lean.skipped, lean.late) == (1, 2)  # 11 skipped, then came late; 13 twice
    # the sequence number wraps at 2**16
    lean = AudioJitterBuffer()
    assert released(lean, [65534, 65535, 0, 1]) == [65534, 65535, 0, 1]
    assert lean.skipped == 0


def test_the_bench_listener_holds_two_packets_as_a_browser_does() -> None:
    """tests/server/webrtc_client.py ``RtcClient(browser_jitter=True)`` (bench/turn_taking.py's
    WebRTC listener) plays a frame once 2 newer packets have come (~40 ms), not aiortc's 4."""
    from tests.server.webrtc_client import BROWSER_PREFETCH, RtcClient

    async def listener() -> JitterBuffer:
        client = RtcClient(browser_jitter=True)
        try:
            receiver = client.pc.getTransceivers()[0].receiver
            buffer = getattr(receiver, JITTER_ATTR)
            assert isinstance(buffer, JitterBuffer)
            return buffer
        finally:
            await client.pc.close()

    assert BROWSER_PREFETCH == 2
    assert released(asyncio.run(listener()), [1, 2, 3, 4]) == [None, None, 1, 2]
