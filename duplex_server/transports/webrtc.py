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
(:class:`~duplex_server.transports.webrtc_track.ReplyTrack`) plays reply audio at real time,
20 ms a frame. Every other server
event is sent, stamped as on the WebSocket, as JSON on the data channel ``oai-events``
that the client opens; client events arrive on it. Audio deltas are not sent as events
(the track carries the audio). ``output_audio_buffer.started`` / ``.stopped`` say when a
response's audio begins and ends playing on the track; a barge-in flushes the track at
once (``output_audio_buffer.cleared``) and the assistant item is truncated to what was
played.

One :class:`WebRtcCall` per call holds its peer connection
(:class:`~duplex_server.transports.webrtc_peer.WebRtcPeer`: SDP, data channel, microphone),
its reply track, and its link to the session
(:class:`~duplex_server.transports.media.MediaLink`: writer, input path, playout reports);
the call routes between them. :func:`routes` serves the HTTP side.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from duplex_contract.errors import EngineError
from duplex_server.auth import SECRET_SESSION
from duplex_server.protocol import events as ev
from duplex_server.protocol.errors import CloseCode, ProtocolError, SessionFatal, to_wire_error
from duplex_server.session import handshake
from duplex_server.session.hub import Hub
from duplex_server.session.live import LiveSession
from duplex_server.transports.media import MediaLink, check_session_patch, merge_patch
from duplex_server.transports.webrtc_peer import WebRtcPeer, use_host_addresses
from duplex_server.transports.webrtc_track import TRACK_RATE, ReplyTrack

log = logging.getLogger(__name__)

MAX_OFFER_BYTES = 256 * 1024


class WebRtcCall:
    """One WebRTC call: its peer connection (:attr:`peer`), its reply track (:attr:`track`)
    and its link to the session (:attr:`link`)."""

    def __init__(self, hub: Hub) -> None:
        self.hub = hub
        s = hub.config.server
        self.track = ReplyTrack(self)
        self.peer = WebRtcPeer(
            self,
            self.track,
            ice_servers=s.webrtc_ice_servers,
            host_addresses=s.webrtc_host_addresses,
        )
        self.link = MediaLink(hub, "webrtc")

    @property
    def session(self) -> LiveSession | None:
        return self.link.session

    @property
    def call_id(self) -> str:
        return self.session.session_id if self.session is not None else "-"

    # ------------------------------------------------------------------ in (PeerListener)
    def receive_message(self, message: str | bytes) -> None:
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

    def receive_mic(self, pcm: bytes, rate: int) -> None:
        feed, session = self.link.feed, self.session
        if feed is not None and session is not None and not session.core.closed:
            feed.push(pcm, rate)

    # ------------------------------------------------------------------ track (TrackListener)
    def emit(self, event: ev.ServerEvent) -> None:
        if self.session is not None and not self.session.core.closed:
            self.session.emit(event)

    def played(self, pcm: bytes) -> None:
        if self.link.feed is not None:
            self.link.feed.reference(pcm, TRACK_RATE)

    def audio_played(self, item_id: str, ms: float, queued_ms: float) -> None:
        self.link.audio_played(item_id, ms, queued_ms)

    # ------------------------------------------------------------------ out (MediaOut)
    async def write_audio(self, event: ev.AudioDelta, pcm: bytes, rate: int) -> None:
        if self.track.enqueue(event, pcm, rate):  # (the track reports it as it plays)
            self.link.audio_queued(event.item_id)

    def audio_done(self, response_id: str) -> None:
        self.track.finish(response_id)

    async def write_event(self, event: ev.ServerEvent, data: bytes) -> None:
        await self.write_raw(data)

    async def write_raw(self, data: bytes) -> None:
        self.peer.send(data.decode())

    async def flush_playout(self) -> None:
        self.track.flush()

    async def hang_up(self, code: int, reason: str) -> None:
        self.peer.gone.set()

    # ------------------------------------------------------------------ lifetime
    async def serve(self) -> None:
        """Until the call ends: events wait for the data channel (or for the connection,
        if the client opened none), then the writer runs."""
        timeout = self.hub.config.server.webrtc_connect_timeout_s
        link, peer = self.link, self.peer
        link.register()
        try:
            try:
                await asyncio.wait_for(self._ready(), timeout)
            except TimeoutError:
                log.info("webrtc %s: the peer did not connect", self.call_id)
                link.end_session("connect_timeout")
            writer = asyncio.create_task(link.run_writer(self), name="webrtc-writer")
            gone = asyncio.create_task(peer.gone.wait())
            await asyncio.wait({writer, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not writer.done():
                link.end_session("hangup")  # the peer went away: the session ends
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(writer), 2.0)
            for task in (writer, gone):
                task.cancel()
            await asyncio.gather(writer, gone, return_exceptions=True)
        finally:
            await peer.close()
            link.unregister()

    async def _ready(self) -> None:
        peer = self.peer
        channel = asyncio.create_task(peer.channel_open.wait())
        connected = asyncio.create_task(self._connected_without_channel())
        gone = asyncio.create_task(peer.gone.wait())
        tasks = {channel, connected, gone}
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()

    async def _connected_without_channel(self) -> None:
        await self.peer.connected.wait()
        await asyncio.sleep(2.0)  # a data channel opens right after the connection


#: under every call's session: the caller's audio reaches the session as 16 kHz PCM, the
#: engine's rate (the track is Opus; what ``audio.input.format`` says only changes how the
#: audio goes inside the server). The default format, 24 kHz PCM, took the audio from 16
#: to 24 kHz and back: two stream resamplers, ~45 ms (up to ~75) on every barge-in and turn
#: end. A call that sets another format still works, and pays that.
WEBRTC_SESSION: dict[str, Any] = {
    "audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}
}


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


def routes(hub: Hub) -> list[BaseRoute]:
    calls: dict[str, WebRtcCall] = {}
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
        minted = request.scope.get("state", {}).get(SECRET_SESSION)
        if minted:  # admitted by a client secret: its session first, the form's over it
            patch = merge_patch(minted, patch)
        patch = merge_patch(WEBRTC_SESSION, patch)
        call = WebRtcCall(hub)
        try:
            answer = await call.peer.answer(offer)
        except ProtocolError as exc:
            await call.peer.close()
            return _error(400, exc.code, str(exc), "sdp")
        except Exception as exc:  # aiortc refuses the offer
            await call.peer.close()
            return _error(400, "invalid_value", f"sdp: {type(exc).__name__}: {exc}", "sdp")
        try:
            session = await call.link.open_session(patch)
        except (ProtocolError, EngineError) as exc:
            await call.peer.close()
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
        call.link.end_session("client")
        return Response(status_code=200)

    return [
        Route("/v1/realtime/calls", create_call, methods=["POST"]),
        Route("/v1/realtime/calls/{call_id}/hangup", hangup, methods=["POST"]),
    ]
