"""GPT-Live over WebRTC and the Live routes this server answers with ``unsupported``.

``POST /v1/live/sessions`` with JSON ``{session, transport: {type: "webrtc", sdp}}`` (the
SDK's ``client.live.create``) starts a Live session on a WebRTC call and answers
``{session: {id}, transport: {type: "webrtc", sdp: <answer>}}``. It reuses the WebRTC
stack (:class:`~duplex_server.transports.webrtc.WebRtcCall`: the peer, the reply track
that plays at real time and reports what it played, the microphone feed); the call's
data channel carries Live events both ways and no ``session.start`` (the POST started the
session). The output transcript leaves as the track plays it
(:class:`~duplex_server.protocol.live_output.SpokenText`). ``POST
/v1/live/sessions/{id}/hangup`` ends it (and a WebSocket Live session too, as
``session.close`` would). Admission: ``duplex_server.auth.HttpAuth`` (the
API key and Origin of every ``/v1/`` route).

Not in scope, each answered with ``unsupported`` (docs/protocol.md): the sideband
(``/v1/live/sessions/{id}/attach``) and fork WebSockets (an ``error`` event, close 1008),
and fork, SIP accept / reject / refer and recordings over HTTP (400).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, Literal

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route, WebSocketRoute
from starlette.websockets import WebSocket

from duplex_contract.errors import EngineError
from duplex_contract.validation import explain
from duplex_server.protocol import events as ev
from duplex_server.protocol.commands import Send
from duplex_server.protocol.errors import CloseCode, ProtocolError, SessionFatal, to_wire_error
from duplex_server.protocol.live_config import parse_start
from duplex_server.protocol.live_events import (
    LiveMark,
    LiveOutputTranscript,
    LiveServerEvent,
    LiveSessionConfig,
)
from duplex_server.protocol.live_output import SpokenText, TextPiece
from duplex_server.session import handshake
from duplex_server.session.hub import Hub
from duplex_server.session.live_runtime import ChatEngine, LiveRuntime, live_options, open_live
from duplex_server.transports.live_socket import live_error_frame
from duplex_server.transports.media_input import InputFeed
from duplex_server.transports.webrtc import MAX_OFFER_BYTES, WebRtcCall

log = logging.getLogger(__name__)


class _Transport(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    type: Literal["webrtc"]
    sdp: str


class LiveCreate(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``POST /v1/live/sessions``'s body."""

    session: LiveSessionConfig
    transport: _Transport


class LiveWebRtcCall(WebRtcCall):
    """A WebRTC call whose data channel speaks the Live wire."""

    def __init__(self, hub: Hub) -> None:
        super().__init__(hub)
        self.runtime: LiveRuntime | None = None
        self.spoken = SpokenText()

    def receive_message(self, message: str | bytes) -> None:
        runtime, session = self.runtime, self.session
        if runtime is None or session is None:
            return
        max_frame = self.hub.config.server.max_frame_bytes
        if len(message) > max_frame:
            session.fail(SessionFatal("frame_too_large", f"message over {max_frame} bytes"))
        elif isinstance(message, bytes):
            session.fail(ProtocolError("invalid_event", "data channel messages are JSON text"))
        else:
            runtime.receive_text(message)

    def emit(self, event: ev.ServerEvent) -> None:
        """The track's ``output_audio_buffer.started`` / ``.stopped``: not on the Live wire."""

    def audio_played(self, item_id: str, ms: float, queued_ms: float) -> None:
        super().audio_played(item_id, ms, queued_ms)
        session = self.session
        if session is None or session.core.closed:
            return
        self._say(self.spoken.through(item_id, ms, session.core.input.input_ms))

    def _say(self, pieces: list[TextPiece]) -> None:
        session = self.session
        if pieces and session is not None and not session.core.closed:
            session.apply(
                [
                    Send(LiveOutputTranscript(delta=p.text, start_ms=p.start_ms, end_ms=p.end_ms))
                    for p in pieces
                ]
            )

    async def write_audio(self, event: ev.AudioDelta, pcm: bytes, rate: int) -> None:
        self.spoken.audio(event.item_id, event.audio_start_ms, len(pcm) * 500 / rate)
        await super().write_audio(event, pcm, rate)

    async def write_event(self, event: ev.ServerEvent, data: bytes) -> None:
        if isinstance(event, LiveMark):
            self.spoken.mark(event.item_id, event.start_ms, event.text)
        elif isinstance(event, ev.AudioDone):  # the words still held for the end
            self._say(self.spoken.ended(event.item_id))
        elif isinstance(event, ev.OutputAudioCleared):  # a stop (a pause keeps the words)
            self.spoken.flush()
        elif isinstance(event, LiveServerEvent):
            await self.write_raw(data)


def _error(status: int, code: str, message: str, param: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"type": kind, "code": code, "message": message, "param": param}}
    return JSONResponse(body, status_code=status)


def _body(raw: bytes) -> LiveCreate:
    try:
        return msgspec.json.decode(raw, type=LiveCreate)
    except msgspec.ValidationError as exc:
        problem = explain(exc, LiveCreate)
        code = {"unknown": "unknown_parameter", "missing": "missing_required_parameter"}.get(
            problem.kind, "invalid_value"
        )
        raise ProtocolError(code, problem.message, param=problem.path or None) from None
    except msgspec.DecodeError as exc:
        raise ProtocolError("invalid_json", f"invalid JSON: {exc}") from None


def routes(hub: Hub, chat: Any) -> list[BaseRoute]:
    """The Live HTTP routes; ``chat()``: the engine client (for delegation backends)."""
    calls: dict[str, LiveWebRtcCall] = {}
    options = live_options(hub.config.server)

    def _ended(call_id: str, task: asyncio.Task[None]) -> None:
        calls.pop(call_id, None)
        if not task.cancelled() and task.exception() is not None:
            log.error("live webrtc %s: call failed", call_id, exc_info=task.exception())

    async def create(request: Request) -> Response:
        raw = await request.body()
        if len(raw) > MAX_OFFER_BYTES:
            return _error(400, "invalid_value", f"the body is over {MAX_OFFER_BYTES} bytes")
        sessions = hub.sessions
        try:
            body = _body(raw)
            start = parse_start(
                body.session,
                options=options,
                default_instructions=sessions.instructions,
                served_model=sessions.model,
                voices=sessions.voices,
                websocket=False,
            )
            sdp = body.transport.sdp
            if not sdp.startswith("v=0") or "m=audio" not in sdp:
                raise ProtocolError(
                    "invalid_value", "sdp is not an SDP offer with audio", param="transport.sdp"
                )
        except ProtocolError as exc:
            return _error(400, exc.code, exc.message, exc.param)
        call = LiveWebRtcCall(hub)
        try:
            answer = await call.peer.answer(sdp)
        except Exception as exc:  # aiortc refuses the offer
            await call.peer.close()
            return _error(
                400, "invalid_value", f"sdp: {type(exc).__name__}: {exc}", "transport.sdp"
            )
        engine: ChatEngine | None = chat()
        try:
            runtime = await open_live(hub, call.link.writer, start, options, engine)
        except (ProtocolError, EngineError) as exc:
            await call.peer.close()
            detail, close = handshake.refusal(exc)
            handshake.outcome(hub, detail.code)
            busy = close == CloseCode.TRY_AGAIN or detail.type != "invalid_request_error"
            return _error(503 if busy else 400, detail.code, detail.message, detail.param)
        call.runtime = runtime
        call.link.writer.session = runtime.session
        call.link.feed = InputFeed(runtime.session)
        handshake.outcome(hub, "live_webrtc_opened")
        call_id = runtime.core.session_id
        calls[call_id] = call
        task = asyncio.create_task(call.serve(), name=f"live-webrtc:{call_id}")
        task.add_done_callback(lambda t: _ended(call_id, t))
        body_out = {"session": {"id": call_id}, "transport": {"type": "webrtc", "sdp": answer}}
        return JSONResponse(body_out, status_code=201)

    async def hangup(request: Request) -> Response:
        sid = request.path_params["session_id"]
        call = calls.get(sid)
        if call is not None:
            call.link.end_session("client")
            return Response(status_code=200)
        session = hub.sessions.live.get(sid)
        if session is None or session.protocol != "live":
            return _error(404, "session_not_found", "no such Live session", "session_id")
        if not session.core.closed:  # a WebSocket session: it closes as on session.close
            session.apply(session.core.close("client"))
        return Response(status_code=200)

    async def unsupported_http(request: Request) -> Response:
        what = request.url.path.rsplit("/", 1)[-1]
        return _error(400, "unsupported", f"Live session {what} is not supported by this server")

    return [
        Route("/v1/live/sessions", create, methods=["POST"]),
        Route("/v1/live/sessions/{session_id}/hangup", hangup, methods=["POST"]),
        *(
            Route(f"/v1/live/sessions/{{session_id}}/{what}", unsupported_http, methods=["POST"])
            for what in ("accept", "reject", "refer", "fork")
        ),
        Route("/v1/live/sessions/{session_id}/content", unsupported_http, methods=["GET"]),
        WebSocketRoute("/v1/live/sessions/{session_id}/attach", unsupported_socket),
        WebSocketRoute("/v1/live/sessions/{session_id}/fork", unsupported_socket),
    ]


async def unsupported_socket(ws: WebSocket) -> None:
    """The sideband and fork WebSockets: an ``unsupported`` error, then close 1008."""
    hub: Hub = ws.app.state.hub
    adm = handshake.admit_socket(hub, ws.headers, ws.scope.get("subprotocols", []))
    await ws.accept(subprotocol=adm.subprotocol)
    if not adm.ok:
        exc: ProtocolError = SessionFatal(adm.code, adm.message)
    else:
        what = ws.url.path.rsplit("/", 1)[-1]
        exc = SessionFatal(
            "unsupported", f"Live {what} sockets are not supported", close_code=CloseCode.POLICY
        )
    data, code = live_error_frame(exc)
    detail, _ = to_wire_error(exc)
    with contextlib.suppress(Exception):
        await ws.send_text(data.decode())
        await ws.close(code, detail.code)
