"""WebRTC (aiortc): ``POST /v1/realtime/calls`` with an SDP offer -> an SDP answer, as in
OpenAI's Realtime WebRTC flow.

The body is the offer itself (``Content-Type: application/sdp``) or a multipart form with
``sdp`` and ``session`` (a JSON session object, applied as a ``session.update`` before the
call starts). The answer comes back ``201`` with ``Content-Type: application/sdp`` and
``Location: /v1/realtime/calls/<call_id>`` (the call id is the session id);
``POST /v1/realtime/calls/<call_id>/hangup`` ends the call. Auth and the Origin allow-list
are the WebSocket path's (``Authorization: Bearer``).

Audio flows as Opus over RTP both ways: the caller's track feeds the session's input (at
the session's input format, after echo control when it is on), and the server's track
(:class:`ReplyTrack`) plays reply audio at real time, 20 ms a frame. Every other server
event is sent, stamped as on the WebSocket, as JSON on the data channel ``oai-events``
that the client opens; client events arrive on it. Audio deltas are not sent as events
(the track carries the audio). ``output_audio_buffer.started`` / ``.stopped`` say when a
response's audio begins and ends playing on the track; a barge-in flushes the track at
once (``output_audio_buffer.cleared``) and the assistant item is truncated to what was
played.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
from aiortc import (
    MediaStreamTrack,
    RTCConfiguration,
    RTCDataChannel,
    RTCIceServer,
    RTCPeerConnection,
    RTCSessionDescription,
)
from aiortc.mediastreams import MediaStreamError
from av import AudioFrame
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from audio_kit.pcm import StreamResampler
from duplex_contract.errors import EngineError
from duplex_server.protocol import events as ev
from duplex_server.protocol.errors import CloseCode, ProtocolError, SessionFatal, to_wire_error
from duplex_server.session import handshake
from duplex_server.session.hub import Hub
from duplex_server.transports.media import MediaAttachment, check_session_patch

log = logging.getLogger(__name__)

CHANNEL = "oai-events"
TRACK_RATE = 48000
PTIME_S = 0.02
TRACK_FRAME = int(TRACK_RATE * PTIME_S)  # 960 samples
MAX_OFFER_BYTES = 256 * 1024


@dataclass
class _Chunk:
    response_id: str
    item_id: str
    start_ms: float  # the chunk's offset in its item's audio
    pcm: bytes  # PCM16 mono at TRACK_RATE
    offset: int = 0  # bytes already played


class ReplyTrack(MediaStreamTrack):
    """The server's audio track: reply audio at real time, silence between replies."""

    kind = "audio"

    def __init__(self, call: WebRtcAttachment) -> None:
        super().__init__()
        self.call = call
        self.queue: deque[_Chunk] = deque()
        self.playing: str | None = None  # response whose audio is on the track
        self.done: set[str] = set()  # responses whose audio has all been queued
        self.queued_bytes = 0  # of the queue, not yet played
        self._resamplers: dict[int, StreamResampler] = {}
        self._start = 0.0
        self._pts = 0

    def enqueue(self, event: ev.AudioDelta, pcm: bytes, rate: int) -> bool:
        """Queue the audio to play; False if the resampler held all of it back."""
        if rate != TRACK_RATE:
            res = self._resamplers.get(rate)
            if res is None:
                res = self._resamplers[rate] = StreamResampler(rate, TRACK_RATE)
            pcm = res.process(pcm)
        if pcm:
            self.queue.append(_Chunk(event.response_id, event.item_id, event.audio_start_ms, pcm))
            self.queued_bytes += len(pcm)
        return bool(pcm)

    def finish(self, response_id: str) -> None:
        """The response's audio is all queued: drain the resamplers' tails into it."""
        self.done.add(response_id)
        last = self.queue[-1] if self.queue else None
        for res in self._resamplers.values():
            tail = res.flush()
            if tail and last is not None and last.response_id == response_id:
                last.pcm += tail
                self.queued_bytes += len(tail)
        self._resamplers.clear()

    def flush(self) -> bool:
        """Barge-in: drop everything not yet played; True if audio was dropped."""
        had = bool(self.queue)
        self.queue.clear()
        self.queued_bytes = 0
        self._resamplers.clear()
        self.playing = None
        return had

    async def recv(self) -> AudioFrame:
        if self.readyState != "live":
            raise MediaStreamError
        if self._pts:
            wait = self._start + self._pts / TRACK_RATE - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
        else:
            self._start = time.monotonic()
        pcm = self._take(TRACK_FRAME * 2)
        frame = AudioFrame(format="s16", layout="mono", samples=TRACK_FRAME)
        frame.planes[0].update(pcm)
        frame.pts = self._pts
        frame.sample_rate = TRACK_RATE
        self._pts += TRACK_FRAME
        self.call.played(pcm)
        return frame

    def _take(self, nbytes: int) -> bytes:
        out = bytearray()
        call = self.call
        while len(out) < nbytes and self.queue:
            chunk = self.queue[0]
            if self.playing != chunk.response_id:
                self.playing = chunk.response_id
                call.emit(ev.OutputAudioStarted(response_id=chunk.response_id))
            part = chunk.pcm[chunk.offset : chunk.offset + nbytes - len(out)]
            out += part
            chunk.offset += len(part)
            self.queued_bytes -= len(part)
            bytes_per_ms = TRACK_RATE / 500  # PCM16 mono
            played_ms = chunk.start_ms + chunk.offset / bytes_per_ms
            call.audio_played(chunk.item_id, played_ms, self.queued_bytes / bytes_per_ms)
            if chunk.offset >= len(chunk.pcm):
                self.queue.popleft()
        playing = self.playing
        if playing is not None and playing in self.done:
            if not self.queue or self.queue[0].response_id != playing:
                self.done.discard(playing)
                self.playing = None
                call.emit(ev.OutputAudioStopped(response_id=playing))
        return bytes(out) + b"\x00" * (nbytes - len(out))


class WebRtcAttachment(MediaAttachment):
    kind = "webrtc"

    def __init__(self, hub: Hub) -> None:
        super().__init__(hub)
        servers = [RTCIceServer(url) for url in hub.config.server.webrtc_ice_servers]
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=servers))
        self.track = ReplyTrack(self)
        self.channel: RTCDataChannel | None = None
        self.channel_open = asyncio.Event()
        self.connected = asyncio.Event()
        self.gone = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------------ set-up
    async def answer(self, offer: str) -> str:
        pc = self.pc
        pc.on("datachannel", self._on_channel)
        pc.on("track", self._on_track)
        pc.on("connectionstatechange", self._on_state)
        if _loopback_only(self.hub.config.server.webrtc_host_addresses):
            offer = _loopback_candidates(offer)
        await pc.setRemoteDescription(RTCSessionDescription(sdp=offer, type="offer"))
        audio = [t for t in pc.getTransceivers() if t.kind == "audio"]
        if not audio:
            raise ProtocolError("invalid_value", "the offer has no audio media", param="sdp")
        audio[0].sender.replaceTrack(self.track)
        audio[0].direction = "sendrecv"
        await pc.setLocalDescription(await pc.createAnswer())
        return pc.localDescription.sdp

    def _on_channel(self, channel: RTCDataChannel) -> None:
        if channel.label != CHANNEL:
            log.info("webrtc: ignoring data channel %r", channel.label)
            return
        self.channel = channel
        channel.on("message", self._on_message)
        if channel.readyState == "open":
            self.channel_open.set()
        else:
            channel.on("open", self.channel_open.set)
        channel.on("close", self.gone.set)

    def _on_message(self, message: str | bytes) -> None:
        session = self.session
        if session is None:
            return
        max_frame = self.hub.config.server.max_frame_bytes
        if len(message) > max_frame:
            too_large = f"message of {len(message)} bytes is over {max_frame}"
            session.fail(SessionFatal("frame_too_large", too_large))
            return
        if isinstance(message, bytes):
            session.fail(ProtocolError("invalid_json", "data channel messages are JSON text"))
            return
        session.receive_text(message)

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
                if self.feed is None or self.session is None or self.session.core.closed:
                    continue
                data = frame.to_ndarray()
                channels = len(frame.layout.channels)
                if frame.format.is_planar:
                    mono = data.mean(axis=0)
                else:
                    mono = data.reshape(-1, channels).mean(axis=1)
                if frame.format.name.startswith("flt"):
                    mono = mono * 32767.0
                pcm = np.clip(mono, -32768, 32767).astype("<i2").tobytes()
                self.feed.push(pcm, frame.sample_rate)

    # ------------------------------------------------------------------ media out
    def emit(self, event: ev.ServerEvent) -> None:
        if self.session is not None and not self.session.core.closed:
            self.session.emit(event)

    def played(self, pcm: bytes) -> None:
        if self.feed is not None:
            self.feed.reference(pcm, TRACK_RATE)

    async def write_audio(self, event: ev.AudioDelta, pcm: bytes, rate: int) -> None:
        if self.track.enqueue(event, pcm, rate):  # (the track reports it as it plays)
            self.audio_queued(event.item_id)

    def audio_done(self, response_id: str) -> None:
        self.track.finish(response_id)

    async def write_event(self, event: ev.ServerEvent, data: bytes) -> None:
        await self.write_raw(data)

    async def write_raw(self, data: bytes) -> None:
        channel = self.channel
        if channel is not None and channel.readyState == "open":
            channel.send(data.decode())

    async def flush_playout(self) -> None:
        self.track.flush()

    async def hang_up(self, code: int, reason: str) -> None:
        self.gone.set()

    # ------------------------------------------------------------------ lifetime
    async def serve(self) -> None:
        """Until the call ends: events wait for the data channel (or for the connection,
        if the client opened none), then the writer runs."""
        timeout = self.hub.config.server.webrtc_connect_timeout_s
        self.register()
        try:
            try:
                await asyncio.wait_for(self._ready(), timeout)
            except TimeoutError:
                log.info("webrtc %s: the peer did not connect", self.call_id)
                self.end_session("connect_timeout")
            writer = asyncio.create_task(self.run_writer(), name="webrtc-writer")
            gone = asyncio.create_task(self.gone.wait())
            await asyncio.wait({writer, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not writer.done():
                self.end_session("hangup")  # the peer went away: the session ends
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(writer), 2.0)
            for task in (writer, gone, *self._tasks):
                task.cancel()
            await asyncio.gather(writer, gone, *self._tasks, return_exceptions=True)
        finally:
            self.track.stop()
            await self.pc.close()
            self.unregister()

    async def _ready(self) -> None:
        channel = asyncio.create_task(self.channel_open.wait())
        connected = asyncio.create_task(self._connected_without_channel())
        gone = asyncio.create_task(self.gone.wait())
        tasks = {channel, connected, gone}
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()

    async def _connected_without_channel(self) -> None:
        await self.connected.wait()
        await asyncio.sleep(2.0)  # a data channel opens right after the connection

    @property
    def call_id(self) -> str:
        return self.session.session_id if self.session is not None else "-"


def _error(status: int, code: str, message: str, param: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"type": kind, "code": code, "message": message, "param": param}}
    return JSONResponse(body, status_code=status)


async def _read_offer(request: Request) -> tuple[str, dict[str, Any]]:
    """The SDP offer and the session patch of a call request; raises ProtocolError."""
    ctype = request.headers.get("content-type", "")
    if int(request.headers.get("content-length") or 0) > MAX_OFFER_BYTES:
        raise ProtocolError("invalid_value", f"the body is over {MAX_OFFER_BYTES} bytes")
    patch: dict[str, Any] = {}
    if ctype.startswith("application/sdp"):
        sdp = (await request.body()).decode(errors="replace")
    elif ctype.startswith("multipart/form-data"):
        form = await request.form(max_part_size=MAX_OFFER_BYTES)
        raw_sdp, raw_session = form.get("sdp"), form.get("session")
        if not isinstance(raw_sdp, str):
            raise ProtocolError("missing_required_parameter", "the form has no sdp", param="sdp")
        sdp = raw_sdp
        if raw_session is not None:
            if not isinstance(raw_session, str):
                raise ProtocolError("invalid_value", "session must be JSON text", param="session")
            try:
                patch = json.loads(raw_session)
            except json.JSONDecodeError as exc:
                raise ProtocolError(
                    "invalid_json", f"session is not JSON: {exc}", param="session"
                ) from None
            if not isinstance(patch, dict):
                raise ProtocolError("invalid_value", "session must be an object", param="session")
            check_session_patch(patch)
    else:
        raise ProtocolError(
            "invalid_value",
            "send the SDP offer as application/sdp or as multipart/form-data (sdp, session)",
            param="content-type",
        )
    if not sdp.startswith("v=0") or "m=audio" not in sdp:
        raise ProtocolError("invalid_value", "sdp is not an SDP offer with audio", param="sdp")
    return sdp, patch


def _loopback_only(addresses: list[str] | None) -> bool:
    return bool(addresses) and all(ipaddress.ip_address(a).is_loopback for a in addresses or [])


def _loopback_candidates(sdp: str) -> str:
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


def routes(hub: Hub) -> list[BaseRoute]:
    calls: dict[str, WebRtcAttachment] = {}
    use_host_addresses(hub.config.server.webrtc_host_addresses)

    def _ended(call_id: str, task: asyncio.Task[None]) -> None:
        calls.pop(call_id, None)
        if not task.cancelled() and task.exception() is not None:
            log.error("webrtc %s: call failed", call_id, exc_info=task.exception())

    async def create_call(request: Request) -> Response:
        # API key and Origin: checked by duplex_server.auth.HttpAuth before this runs
        try:
            offer, patch = await _read_offer(request)
        except ProtocolError as exc:
            detail, _ = to_wire_error(exc)
            return _error(400, detail.code, detail.message, detail.param)
        call = WebRtcAttachment(hub)
        try:
            answer = await call.answer(offer)
        except ProtocolError as exc:
            await call.pc.close()
            return _error(400, exc.code, str(exc), "sdp")
        except Exception as exc:  # aiortc refuses the offer
            await call.pc.close()
            return _error(400, "invalid_value", f"sdp: {type(exc).__name__}: {exc}", "sdp")
        try:
            session = await call.open_session(patch)
        except (ProtocolError, EngineError) as exc:
            await call.pc.close()
            detail, close = handshake.refusal(exc)
            busy = close == CloseCode.TRY_AGAIN or detail.type != "invalid_request_error"
            handshake.outcome(hub, detail.code)
            return _error(503 if busy else 400, detail.code, detail.message, detail.param)
        call_id = session.session_id
        calls[call_id] = call
        task = asyncio.create_task(call.serve(), name=f"webrtc:{call_id}")
        task.add_done_callback(lambda t: _ended(call_id, t))
        headers = {"Location": f"/v1/realtime/calls/{call_id}"}
        return Response(answer, status_code=201, media_type="application/sdp", headers=headers)

    async def hangup(request: Request) -> Response:
        call = calls.get(request.path_params["call_id"])
        if call is None:
            return _error(404, "call_not_found", "no such call", "call_id")
        call.end_session("client")
        return Response(status_code=200)

    return [
        Route("/v1/realtime/calls", create_call, methods=["POST"]),
        Route("/v1/realtime/calls/{call_id}/hangup", hangup, methods=["POST"]),
    ]
