"""Twilio Media Streams at ``/v1/twilio``: a phone call as a live session.

Twilio opens a WebSocket (TwiML ``<Connect><Stream url="wss://HOST/v1/twilio">``) and
sends JSON messages: ``connected``, ``start`` (``streamSid``, ``mediaFormat``,
``customParameters``), ``media`` (base64 G.711 mu-law, 8 kHz, 20 ms), ``mark`` (a mark we
sent has been played), ``dtmf`` (a keypad digit: the session's
``input_audio_buffer.dtmf_event_received``) and ``stop``. We send ``media`` (the reply, mu-law),
``mark`` after each chunk (named ``<item_id>:<end_ms>``, so its echo says what the caller
heard) and ``clear`` on a barge-in (Twilio drops what it buffered; the assistant item is
truncated to the last mark echoed).

Session settings ride the ``start`` message's custom parameters (TwiML ``<Parameter>``):
``session`` (a JSON session object as in ``session.update``) and ``api_key`` (Twilio
cannot send an ``Authorization`` header). With ``server.twilio`` holding the account's auth
token, the upgrade must carry a valid ``X-Twilio-Signature``
(:mod:`duplex_server.transports.twilio_signature`); the ``api_key`` parameter is then a fallback for
an upgrade without one, unless ``api_key_fallback`` is off. The audio formats are the
transport's own and echo control is on unless ``session`` turns it off. A malformed
message is logged and counted; the call goes on. ``stop`` (or the socket closing) ends the session.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import msgspec
from starlette.websockets import WebSocket, WebSocketDisconnect

from audio_kit.g711 import g711_to_pcm16
from duplex_contract.errors import EngineError
from duplex_server.auth import key_matches
from duplex_server.protocol import events as ev
from duplex_server.protocol.dtmf import DIGITS
from duplex_server.protocol.errors import CloseCode, ProtocolError
from duplex_server.session import handshake
from duplex_server.session.hub import Hub
from duplex_server.transports import twilio_wire as wire
from duplex_server.transports.media import MediaAttachment, check_session_patch, merge_patch
from duplex_server.transports.twilio_signature import candidate_urls, verify
from duplex_server.transports.twilio_wire import Malformed

log = logging.getLogger(__name__)

TWILIO_RATE = wire.RATE
#: what every Twilio session uses (the formats are the transport's, not the caller's)
TWILIO_SESSION: dict[str, Any] = {
    "audio": {
        "input": {"format": {"type": "audio/pcm", "rate": 16000}},
        "output": {"format": {"type": "audio/pcmu"}},
    }
}


class TwilioAttachment(MediaAttachment):
    kind = "twilio"

    def __init__(self, hub: Hub, ws: WebSocket) -> None:
        super().__init__(hub)
        self.ws = ws
        self.stream_sid = ""
        self.marks_sent = 0
        self.marks_played = 0
        self.clears_sent = 0
        self._cleared: set[str] = set()  # items cleared: their late marks are ignored
        self._mark_pos: dict[str, int] = {}  # mark name -> playout position (echo control)
        self._sent_end: dict[str, float] = {}  # item -> ms of its audio sent (samples)
        #: the handshake's own credentials were enough (else customParameters.api_key)
        self.admitted = False

    # ------------------------------------------------------------------ out
    async def _send(self, msg: wire.Outbound) -> None:
        await self.ws.send_text(wire.encode(msg))

    async def write_audio(self, event: ev.AudioDelta, pcm: bytes, rate: int) -> None:
        sid = self.stream_sid
        await self._send(wire.SendMedia(streamSid=sid, media=wire.OutMedia(event.delta)))
        self.audio_queued(event.item_id)  # its mark's echo reports it played
        # the mark names where this chunk ends in the item's audio as sent (samples, not
        # the engine's ms: the resampler to 8 kHz holds some back, unevenly), so that its
        # echo never claims more than the caller heard; playout is pending until it echoes
        item = event.item_id
        end = self._sent_end.get(item, 0.0) + len(pcm) / (2 * rate) * 1000
        self._sent_end[item] = end
        end_ms = round(end)
        name = f"{item}:{end_ms}"
        if self.feed is not None:
            pos = self.feed.reference(pcm, rate)
            if pos:
                self._mark_pos[name] = pos
        await self._send(wire.SendMark(streamSid=sid, mark=wire.OutMark(name)))
        self.marks_sent += 1

    async def write_event(self, event: ev.ServerEvent, data: bytes) -> None:
        if isinstance(event, ev.Error):
            log.warning("twilio %s: %s", self.stream_sid, event.error.message)

    async def write_raw(self, data: bytes) -> None:
        log.warning("twilio %s: %s", self.stream_sid, data.decode(errors="replace"))

    async def flush_playout(self) -> None:
        if self.audio_item is not None:
            self._cleared.add(self.audio_item)
        self._mark_pos.clear()
        await self._send(wire.Clear(streamSid=self.stream_sid))
        self.clears_sent += 1

    async def hang_up(self, code: int, reason: str) -> None:
        try:
            await self.ws.close(code, reason)
        except Exception:  # already closed by Twilio
            log.debug("twilio socket already closed", exc_info=True)

    # ------------------------------------------------------------------ in
    async def serve(self) -> None:
        async with asyncio.TaskGroup() as tg:
            writer = tg.create_task(self._writer(), name="twilio-writer")
            reader = tg.create_task(self._reader(), name="twilio-reader")
            reader.add_done_callback(lambda _: self._reader_done(writer))

    def _reader_done(self, writer: asyncio.Task[None]) -> None:
        if self._close is None:  # Twilio went away without stop
            self.end_session("hangup")
        if self.session is None:
            writer.cancel()

    async def _writer(self) -> None:
        try:
            await self.run_writer()
        except WebSocketDisconnect:
            # Twilio went away while we sent: the call is over (the reader sees the
            # disconnect too); nothing to write to, and nothing to report as an error
            self.end_session("hangup")

    async def _reader(self) -> None:
        max_frame = self.hub.config.server.max_frame_bytes
        try:
            while True:
                msg = await self.ws.receive()
                if msg["type"] == "websocket.disconnect":
                    return
                text = msg.get("text")
                if text is None or len(text) > max_frame:
                    self._malformed("not a text frame within max_frame_bytes")
                    continue
                try:
                    if not await self._handle(text):
                        return
                except Malformed as exc:
                    self._malformed(str(exc))
        except WebSocketDisconnect:
            return

    def _malformed(self, why: str) -> None:
        log.warning("twilio %s: malformed message ignored: %s", self.stream_sid or "-", why)
        self.hub.metrics.errors.labels("twilio_malformed").inc()

    async def _handle(self, text: str) -> bool:
        """One Twilio message; False when the call is over."""
        try:
            msg = wire.decode(text)
        except wire.Malformed as exc:
            if self.session is None and exc.event in ("media", "mark", "dtmf"):
                return True  # before start (or after a refused start): nothing to feed
            raise
        if isinstance(msg, wire.Connected):
            return True
        if isinstance(msg, wire.Start):
            return await self._start(msg)
        if isinstance(msg, wire.Stop):
            self.end_session("client")
            return False
        if self.session is None:
            return True  # media, mark or dtmf before start: nothing to feed
        if isinstance(msg, wire.Media):
            self._media(msg)
        elif isinstance(msg, wire.Mark):
            self._mark(msg)
        else:
            self._dtmf(msg)
        return True

    async def _start(self, msg: wire.Start) -> bool:
        if self.session is not None:
            raise Malformed("a second start", "start")
        start = msg.body
        self.stream_sid = msg.stream_sid
        fmt = start.media_format
        if fmt.encoding != wire.ENCODING or fmt.sampleRate != TWILIO_RATE:
            raise Malformed(f"unsupported mediaFormat {msgspec.to_builtins(fmt)}", "start")
        params = start.parameters
        try:
            if not self._authorized(params):
                raise ProtocolError("unauthorized", "missing or invalid API key")
            patch: dict[str, Any] = {"audio": {"input": {"echo_cancellation": True}}}
            if params.get("session"):
                user = json.loads(params["session"])
                if not isinstance(user, dict):
                    raise ProtocolError("invalid_value", "session must be a JSON object")
                patch = merge_patch(patch, user)
            patch = merge_patch(patch, TWILIO_SESSION)
            check_session_patch(patch)
            await self.open_session(patch)
        except json.JSONDecodeError as exc:
            log.warning("twilio %s: customParameters.session is not JSON: %s", self.stream_sid, exc)
            handshake.outcome(self.hub, "invalid_value")
            self.close(CloseCode.POLICY, "invalid_value")
            return False
        except (ProtocolError, EngineError) as exc:
            detail, _ = handshake.refusal(exc)
            log.warning("twilio %s: call refused: %s", self.stream_sid, detail.message)
            handshake.outcome(self.hub, detail.code)
            self.close(CloseCode.POLICY, detail.code)
            return False
        return True

    def _authorized(self, params: dict[str, str]) -> bool:
        if self.admitted:
            return True
        key = params.get("api_key")
        return key is not None and key_matches(key, self.hub.keys)

    def _media(self, msg: wire.Media) -> None:
        ulaw = msg.media.payload
        if msg.inbound and ulaw and self.feed is not None:
            self.feed.push(g711_to_pcm16(ulaw, "g711_ulaw"), TWILIO_RATE)

    def _dtmf(self, msg: wire.Dtmf) -> None:
        """``{"event": "dtmf", "dtmf": {"track": "inbound_track", "digit": "1"}}``."""
        digit = msg.dtmf.digit
        if digit not in DIGITS:
            raise Malformed(f"dtmf without a keypad digit: {digit!r}", "dtmf")
        assert self.session is not None
        self.session.receive_dtmf(digit, int(time.time()))

    def _mark(self, msg: wire.Mark) -> None:
        item, end_ms = msg.position()
        name = msg.mark.name
        self.marks_played += 1
        if item in self._cleared:
            return  # Twilio echoes the marks of cleared audio: it was never heard
        self.audio_played(item, end_ms, round(self._sent_end.get(item, end_ms)) - end_ms)
        pos = self._mark_pos.pop(name, None)
        if pos is not None and self.feed is not None and self.feed.echo is not None:
            self.feed.echo.played_through(pos)


def _admit(ws: WebSocket, hub: Hub) -> tuple[bool, str, str]:
    """(admitted by the handshake alone, refusal code or "", why) for a Twilio upgrade.

    Signing off (no auth token): the API key, as on every socket, or later in
    ``customParameters``. Signing on: a valid ``X-Twilio-Signature`` admits; a bad one is
    refused; a missing one is refused unless the API-key fallback is on and keys exist."""
    s = hub.config.server
    adm = handshake.admit_socket(hub, ws.headers, [])
    if not adm.ok and adm.code != "unauthorized":
        return False, adm.code, adm.message
    token = s.twilio.token()
    if token is None:
        return adm.ok, "", ""  # without a key, one may still come in customParameters
    urls = candidate_urls(
        s.twilio.public_url,
        scheme=ws.url.scheme,
        host=ws.headers.get("host", ""),
        path=ws.url.path,
        query=ws.url.query,
    )
    verdict = verify(token, ws.headers.get("x-twilio-signature"), urls)
    if verdict == "signed":
        return True, "", ""
    if verdict == "invalid":
        return False, "twilio_signature_invalid", "X-Twilio-Signature does not sign this URL"
    if not s.twilio.api_key_fallback or not hub.keys:
        return False, "twilio_signature_missing", "no X-Twilio-Signature"
    return adm.ok, "", ""  # the API-key fallback


async def twilio_endpoint(ws: WebSocket) -> None:
    hub: Hub = ws.app.state.hub
    admitted, refused, why = _admit(ws, hub)
    await ws.accept()
    att = TwilioAttachment(hub, ws)
    att.admitted = admitted
    if refused:
        log.warning("twilio: refused: %s", why)
        handshake.outcome(hub, refused)
        await ws.close(CloseCode.POLICY, refused)
        return
    att.register()
    try:
        await att.serve()
    finally:
        att.unregister()
        try:
            await ws.close(CloseCode.NORMAL)
        except Exception:
            log.debug("twilio socket already closed", exc_info=True)
