"""The WebRTC peer's microphone path: aiortc's jitter buffer releases each of the caller's
audio frames as soon as it is complete, not 4 packets later (duplex_server/transports/
webrtc_peer.py: the server reads frames as they come, so aiortc's player cushion was ~80 ms
on every barge-in and every turn end)."""

from __future__ import annotations

import asyncio

from aiortc import RTCPeerConnection
from aiortc.jitterbuffer import JitterBuffer
from aiortc.mediastreams import AudioStreamTrack
from aiortc.rtp import RtpPacket

from duplex_server.transports.webrtc_peer import WebRtcPeer

#: where aiortc 1.16's RTCRtpReceiver keeps its jitter buffer
JITTER_ATTR = "_RTCRtpReceiver__jitter_buffer"
OPUS_FRAME = 960  # RTP timestamp units per 20 ms packet at 48 kHz


class Listener:
    def receive_message(self, message: str | bytes) -> None:
        pass

    def receive_mic(self, pcm: bytes, rate: int) -> None:
        pass


def packet(seq: int) -> RtpPacket:
    out = RtpPacket(payload_type=111, sequence_number=seq, timestamp=seq * OPUS_FRAME)
    out._data = b"\xfc"  # type: ignore[attr-defined]  # (the receiver sets it: the payload)
    return out


def released(buffer: JitterBuffer, seqs: list[int]) -> list[int | None]:
    """For each packet added in turn, the timestamp's packet number of the frame it lets go
    (None: none yet)."""
    out: list[int | None] = []
    for seq in seqs:
        _, frame = buffer.add(packet(seq))
        out.append(None if frame is None else frame.timestamp // OPUS_FRAME)
    return out


def test_the_callers_audio_leaves_the_jitter_buffer_when_the_next_packet_comes() -> None:
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
    # packet 1 is complete once packet 2 comes; aiortc's own buffer waits for packet 5
    assert released(buffer, [1, 2, 3, 4]) == [None, 1, 2, 3]
    assert released(JitterBuffer(capacity=16, prefetch=4), [1, 2, 3, 4, 5]) == [
        None,
        None,
        None,
        None,
        1,
    ]
    # out of order: a frame still waits for the packet before it
    lean = JitterBuffer(capacity=buffer.capacity, prefetch=buffer._prefetch)
    assert released(lean, [10, 12, 11, 13]) == [None, None, 10, 11]


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
