"""A WebRTC call's peer connection (aiortc): the SDP answer, the data channel, the caller's
microphone track, and the connection's state.

:class:`WebRtcPeer` answers the offer with the call's reply track
(:class:`~duplex_server.transports.webrtc_track.ReplyTrack`) as the server's audio, keeps the
data channel ``oai-events`` the client opens, and hands what arrives to its
:class:`PeerListener` (the call): each data channel message, and the caller's audio as PCM16
mono (:func:`frame_pcm`). ``channel_open``, ``connected`` and ``gone`` say how far the
connection got; nothing here knows the session. A loopback-only server drops the offer's
other candidates (:func:`loopback_candidates`), and :func:`use_host_addresses` limits the
host candidates offered.

The caller's audio leaves aiortc's jitter buffer the moment its packet comes
(:func:`lean_jitter_buffer`, :class:`AudioJitterBuffer`): aiortc holds each audio frame until
4 newer packets have come (~80 ms), a cushion for a player with a clock. The server has none:
it reads each frame as it comes (its VAD, the echo canceller and the ASR keep their own time),
so the cushion was 80 ms added to every barge-in and every turn end on WebRTC. aiortc's buffer
also counts a frame complete only when a packet of the next frame comes (a video frame spans
packets); an Opus packet is one whole frame, so that wait (20 ms) is gone too. Nor does a
packet wait for a missing one before it: aiortc's buffer did, until it was full, and then
stayed that full, every later frame ~300 ms late for the rest of the call; a gap is now
skipped, and a packet that comes after a later one is dropped, as lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
from typing import Protocol

import numpy as np
from aiortc import (
    MediaStreamTrack,
    RTCConfiguration,
    RTCDataChannel,
    RTCIceServer,
    RTCPeerConnection,
    RTCSessionDescription,
)
from aiortc.jitterbuffer import JitterBuffer, JitterFrame
from aiortc.mediastreams import MediaStreamError
from aiortc.rtp import RtpPacket
from aiortc.utils import uint16_add
from av import AudioFrame

from duplex_server.protocol.errors import ProtocolError

log = logging.getLogger(__name__)

CHANNEL = "oai-events"
#: aiortc 1.16's audio jitter buffer (rtcrtpreceiver.py): 16 packets, a frame released after
#: 4 newer ones; here the moment it comes (:class:`AudioJitterBuffer`)
JITTER_CAPACITY, MIC_PREFETCH = 16, 0
_JITTER_ATTR = "_RTCRtpReceiver__jitter_buffer"


class PeerListener(Protocol):
    """What the peer connection hands the call."""

    def receive_message(self, message: str | bytes) -> None:
        """A message on the data channel."""
        ...

    def receive_mic(self, pcm: bytes, rate: int) -> None:
        """The caller's audio: PCM16 mono at ``rate``."""
        ...


def frame_pcm(frame: AudioFrame) -> bytes:
    """One received audio frame as PCM16 mono (channels averaged, float scaled)."""
    data = frame.to_ndarray()
    channels = len(frame.layout.channels)
    if frame.format.is_planar:
        mono = data.mean(axis=0)
    else:
        mono = data.reshape(-1, channels).mean(axis=1)
    if frame.format.name.startswith("flt"):
        mono = mono * 32767.0
    return bytes(np.clip(mono, -32768, 32767).astype("<i2").tobytes())


class WebRtcPeer:
    """One peer connection; ``track``: the server's audio, answered as ``sendrecv``."""

    def __init__(
        self,
        listener: PeerListener,
        track: MediaStreamTrack,
        *,
        ice_servers: list[str],
        host_addresses: list[str] | None = None,
    ) -> None:
        self.listener = listener
        self.track = track
        servers = [RTCIceServer(url) for url in ice_servers]
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=servers))
        self.loopback_only = loopback_only(host_addresses)
        self.channel: RTCDataChannel | None = None
        self.channel_open = asyncio.Event()
        self.connected = asyncio.Event()
        self.gone = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()

    async def answer(self, offer: str) -> str:
        """The SDP answer to ``offer``; raises :class:`ProtocolError` if it has no audio."""
        pc = self.pc
        pc.on("datachannel", self._on_channel)
        pc.on("track", self._on_track)
        pc.on("connectionstatechange", self._on_state)
        if self.loopback_only:
            offer = loopback_candidates(offer)
        await pc.setRemoteDescription(RTCSessionDescription(sdp=offer, type="offer"))
        audio = [t for t in pc.getTransceivers() if t.kind == "audio"]
        if not audio:
            raise ProtocolError("invalid_value", "the offer has no audio media", param="sdp")
        lean_jitter_buffer(audio[0].receiver)
        audio[0].sender.replaceTrack(self.track)
        audio[0].direction = "sendrecv"
        await pc.setLocalDescription(await pc.createAnswer())
        return str(pc.localDescription.sdp)

    def send(self, text: str) -> None:
        """``text`` on the data channel, if it is open (else dropped)."""
        channel = self.channel
        if channel is not None and channel.readyState == "open":
            channel.send(text)

    async def close(self) -> None:
        """Stop reading the microphone, stop the track, close the connection."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.track.stop()
        await self.pc.close()

    def _on_channel(self, channel: RTCDataChannel) -> None:
        if channel.label != CHANNEL:
            log.info("webrtc: ignoring data channel %r", channel.label)
            return
        self.channel = channel
        channel.on("message", self.listener.receive_message)
        if channel.readyState == "open":
            self.channel_open.set()
        else:
            channel.on("open", self.channel_open.set)
        channel.on("close", self.gone.set)

    def _on_track(self, track: MediaStreamTrack) -> None:
        if track.kind == "audio":
            task = asyncio.create_task(self._read_mic(track), name="webrtc-mic")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _on_state(self) -> None:
        state = self.pc.connectionState
        if state == "connected":
            self.connected.set()
        elif state in ("failed", "closed"):
            self.gone.set()

    async def _read_mic(self, track: MediaStreamTrack) -> None:
        with contextlib.suppress(MediaStreamError):
            while True:
                frame = await track.recv()
                assert isinstance(frame, AudioFrame)
                self.listener.receive_mic(frame_pcm(frame), frame.sample_rate)


class AudioJitterBuffer(JitterBuffer):
    """aiortc's jitter buffer for a codec whose every packet is a whole frame (Opus, as
    WebRTC carries it: RFC 7587 §4.2), for a reader that keeps its own time: each packet is
    released as it comes.

    aiortc's own finds a frame's end only when a packet with the next timestamp comes (one
    packet late), waits for a missing packet until the buffer is full, and then lets one
    frame go per packet added (its receiver decodes one frame per packet): one lost packet
    left every later frame ~15 packets (300 ms) late for the rest of the call. Here nothing
    waits: a gap is skipped (``skipped`` counts its packets) and a packet that comes after a
    later one is dropped (``late``), as lost."""

    def __init__(self, capacity: int = JITTER_CAPACITY) -> None:
        super().__init__(capacity=capacity, prefetch=0)
        self.skipped = 0  # packets never seen before a later one came
        self.late = 0  # packets that came after a later one (dropped)

    def add(self, packet: RtpPacket) -> tuple[bool, JitterFrame | None]:
        seq = packet.sequence_number
        if self._origin is not None:  # the next packet expected
            ahead = uint16_add(seq, -self._origin)
            if ahead >= 0x8000:  # behind it: late, or a duplicate
                self.late += 1
                return False, None
            self.skipped += ahead
        self._origin = uint16_add(seq, 1)
        # (the payload is the frame: aiortc depayloads audio as it is, video alone has a
        # payload format)
        return False, JitterFrame(data=packet.payload, timestamp=packet.timestamp)


def lean_jitter_buffer(receiver: object, prefetch: int = MIC_PREFETCH) -> bool:
    """Give ``receiver`` (an aiortc ``RTCRtpReceiver`` for audio, before its first packet) a
    jitter buffer that releases each frame once ``prefetch`` newer packets have come (the
    default :data:`MIC_PREFETCH`, 0: as its packet comes, :class:`AudioJitterBuffer`). False
    (and nothing changed) where aiortc keeps it elsewhere than 1.16 does."""
    if not isinstance(getattr(receiver, _JITTER_ATTR, None), JitterBuffer):
        log.warning("webrtc: aiortc's jitter buffer not found; it keeps its 80 ms cushion")
        return False
    buffer = (
        AudioJitterBuffer()
        if prefetch == 0
        else JitterBuffer(capacity=JITTER_CAPACITY, prefetch=prefetch)
    )
    setattr(receiver, _JITTER_ATTR, buffer)
    return True


def loopback_only(addresses: list[str] | None) -> bool:
    return bool(addresses) and all(ipaddress.ip_address(a).is_loopback for a in addresses or [])


def loopback_candidates(sdp: str) -> str:
    """Drop the offer's candidates a loopback-only server cannot reach anyway (so its ICE
    checks never leave loopback)."""
    keep = []
    for line in sdp.splitlines():
        if line.startswith("a=candidate:"):
            parts = line.split()
            try:
                if len(parts) < 5 or not ipaddress.ip_address(parts[4]).is_loopback:
                    continue
            except ValueError:  # an mDNS name: not loopback
                continue
        keep.append(line)
    return "\r\n".join(keep) + "\r\n"


def use_host_addresses(addresses: list[str] | None) -> None:
    """Offer only ``addresses`` as ICE host candidates (aioice has no per-connection knob:
    its module-level lookup is replaced, for every peer connection of this process)."""
    if addresses is None:
        return
    import aioice.ice

    chosen = list(addresses)

    def host_addresses(use_ipv4: bool, use_ipv6: bool) -> list[str]:
        return [a for a in chosen if (":" in a and use_ipv6) or (":" not in a and use_ipv4)]

    aioice.ice.get_host_addresses = host_addresses
