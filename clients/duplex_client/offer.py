"""``duplex-client offer``: an SDP offer for ``POST /v1/realtime/calls``, made with aiortc.

The offer has what the server's WebRTC endpoint expects of a caller (docs/protocol.md,
WebRTC): one ``sendrecv`` audio section (Opus) and the ``oai-events`` data channel, with the
host's ICE candidates gathered (no trickle). It shows the HTTP exchange (the answer comes
back ``201``); the peer that made the offer is gone once it is written, so the server ends
that call when no one connects (``server.webrtc_connect_timeout_s``). A real call keeps its
peer connection: the browser page's WebRTC mode, or aiortc in your own program.
"""

from __future__ import annotations

CHANNEL = "oai-events"


async def make_offer() -> str:
    """The SDP text of a fresh offer (audio sendrecv + the ``oai-events`` data channel)."""
    from aiortc import RTCConfiguration, RTCPeerConnection

    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    try:
        pc.addTransceiver("audio", direction="sendrecv")
        pc.createDataChannel(CHANNEL)
        await pc.setLocalDescription(await pc.createOffer())  # gathers the candidates
        sdp: str = pc.localDescription.sdp
        return sdp
    finally:
        await pc.close()
