"""A Twilio Media Streams peer for tests: what Twilio does on the other end of /v1/twilio.

It speaks the documented protocol over a real WebSocket: ``connected``, ``start`` (with
``customParameters``), ``media`` every 20 ms (mu-law 8 kHz) in real time, ``stop``. It
plays what it receives at real time from a buffer, echoes each ``mark`` once the audio
before it has played, and on ``clear`` drops its buffer and echoes the pending marks (as
Twilio does). Its microphone is a script of PCM to say plus, optionally, the bot's own
playout fed back (``echo_delay_ms`` later, ``echo_gain`` times as loud): a speakerphone, and
line noise (``noise_rms``). It keeps when each message arrived and when each frame of the
script was sent (bench/turn_taking.py times the caller's speech and the clears by them).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
import weakref
from typing import Any

import numpy as np
import websockets
from starlette.websockets import WebSocketState

from audio_kit.g711 import g711_to_pcm16, pcm16_to_g711
from tests.server.harness import UNIT

RATE = 8000
FRAME = 160  # 20 ms


def tone8k(ms: float, amp: float = 0.3, hz: float = 300.0) -> bytes:
    n = int(RATE * ms / 1000)
    t = np.arange(n) / RATE
    return (np.sin(2 * np.pi * hz * t) * amp * 32767).astype("<i2").tobytes()


class TwilioSim:
    def __init__(
        self,
        ws: websockets.ClientConnection,
        *,
        echo_delay_ms: float | None = None,
        echo_gain: float = 0.5,
        noise_rms: float = 0.0,
        seed: int = 0,
    ) -> None:
        self.ws = ws
        self.sid = "MZ00000000000000000000000000000001"
        self.playout = bytearray()  # PCM16 8 kHz not yet played
        self.pending: list[tuple[int, str]] = []  # (position in bytes played+queued, name)
        self.queued = 0  # bytes ever queued (positions of marks)
        self.played = 0  # bytes ever played
        self.heard = bytearray()  # everything played
        self.say = bytearray()  # the caller's own voice still to send
        self.media_in = 0
        self.marks_in: list[str] = []
        self.marks_echoed: list[str] = []
        self.clears = 0
        self.clear_times: list[float] = []
        #: for each mark echoed (as ``marks_echoed``): whether its audio was played (False:
        #: echoed by a clear, never heard)
        self.echo_heard: list[bool] = []
        #: for each clear: how far the item playing had played (ms of its audio as sent,
        #: counted from the last mark played and the bytes played since)
        self.clear_content_ms: list[tuple[str, float]] = []  # (item_id, ms)
        #: the last mark played: (its item, its ms, where it ended in the bytes played)
        self._last_heard: tuple[str, float, int] | None = None
        self.received: list[dict[str, Any]] = []
        self.received_at: list[float] = []  # when each message of ``received`` came
        #: (time sent, voice bytes sent so far) for each media frame that carried voice
        self.voice_sent: list[tuple[float, int]] = []
        self._voice_total = 0
        self.echo_gain = echo_gain
        self.noise_rms = noise_rms  # line noise (white, RMS of PCM16) on the microphone
        self._rng = np.random.default_rng(seed)
        n_delay = 0 if echo_delay_ms is None else int(RATE * echo_delay_ms / 1000) * 2
        self.echo_line: bytearray | None = None if echo_delay_ms is None else bytearray(n_delay)
        self.closed = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    @classmethod
    @contextlib.asynccontextmanager
    async def call(
        cls,
        addr: str,
        params: dict[str, str] | None = None,
        headers: dict[str, str] | None = None,
        **kw: Any,
    ) -> Any:
        """A call; ``headers`` go on the upgrade (``X-Twilio-Signature``)."""
        url = f"ws://{addr}/v1/twilio"
        async with websockets.connect(url, max_size=None, additional_headers=headers) as ws:
            sim = cls(ws, **kw)
            await sim._open(params)
            sim._tasks = [
                asyncio.create_task(sim._receive()),
                asyncio.create_task(sim._clock()),
            ]
            try:
                yield sim
            finally:
                for task in sim._tasks:
                    task.cancel()
                await asyncio.gather(*sim._tasks, return_exceptions=True)

    async def _open(self, params: dict[str, str] | None) -> None:
        """``connected`` and ``start`` (a server that refused the upgrade has closed)."""
        with contextlib.suppress(websockets.ConnectionClosed):
            await self.send({"event": "connected", "protocol": "Call", "version": "1.0.0"})
            await self.send(
                {
                    "event": "start",
                    "sequenceNumber": "1",
                    "streamSid": self.sid,
                    "start": {
                        "streamSid": self.sid,
                        "accountSid": "AC0",
                        "callSid": "CA0",
                        "tracks": ["inbound"],
                        "mediaFormat": {
                            "encoding": "audio/x-mulaw",
                            "sampleRate": 8000,
                            "channels": 1,
                        },
                        "customParameters": params or {},
                    },
                }
            )

    async def send(self, obj: dict[str, Any]) -> None:
        await self.ws.send(json.dumps(obj))

    async def stop(self) -> None:
        await self.send({"event": "stop", "streamSid": self.sid, "stop": {"callSid": "CA0"}})

    async def dtmf(self, digit: str, seq: int) -> None:
        """A keypad press, as Twilio sends it on a bidirectional stream."""
        await self.send(
            {
                "event": "dtmf",
                "streamSid": self.sid,
                "sequenceNumber": str(seq),
                "dtmf": {"track": "inbound_track", "digit": digit},
            }
        )

    def speak(self, pcm8k: bytes) -> None:
        self.say += pcm8k

    async def _receive(self) -> None:
        try:
            async for raw in self.ws:
                msg = json.loads(raw)
                self.received.append(msg)
                self.received_at.append(time.monotonic())
                kind = msg["event"]
                assert msg["streamSid"] == self.sid
                if kind == "media":
                    pcm = g711_to_pcm16(base64.b64decode(msg["media"]["payload"]), "g711_ulaw")
                    self.playout += pcm
                    self.queued += len(pcm)
                    self.media_in += 1
                elif kind == "mark":
                    name = msg["mark"]["name"]
                    self.marks_in.append(name)
                    self.pending.append((self.queued, name))
                elif kind == "clear":
                    self.clears += 1
                    self.clear_times.append(time.monotonic())
                    if self._last_heard is not None:
                        item, mark_ms, at = self._last_heard
                        played_ms = (self.played - at) / (RATE * 2 / 1000)
                        self.clear_content_ms.append((item, mark_ms + played_ms))
                    self.queued -= len(self.playout)
                    self.playout.clear()
                    for _, name in self.pending:
                        await self._echo_mark(name)
                    self.pending.clear()
        except websockets.ConnectionClosed:
            pass
        finally:
            self.closed.set()

    async def _echo_mark(self, name: str, at: int | None = None) -> None:
        """Echo mark ``name``; ``at``: where its audio ended in the bytes played (None: it
        was cleared, never heard)."""
        self.marks_echoed.append(name)
        self.echo_heard.append(at is not None)
        if at is not None:  # (the server names its marks ``<item_id>:<end_ms>``)
            item, end_ms = name.rsplit(":", 1)
            self._last_heard = (item, float(end_ms), at)
        await self.send({"event": "mark", "streamSid": self.sid, "mark": {"name": name}})

    async def _clock(self) -> None:
        """Every 20 ms: play 20 ms, echo the marks played, send 20 ms of microphone."""
        seq, t0 = 0, time.monotonic()
        zero = b"\x00\x00" * FRAME
        with contextlib.suppress(websockets.ConnectionClosed):
            while True:
                seq += 1
                played = bytes(self.playout[: FRAME * 2])
                del self.playout[: FRAME * 2]
                self.played += len(played)
                played += zero[len(played) :]
                self.heard += played
                while self.pending and self.pending[0][0] <= self.played:
                    await self._echo_mark(*reversed(self.pending.pop(0)))
                mic = np.zeros(FRAME, dtype=np.float64)
                voice = bytes(self.say[: FRAME * 2])
                del self.say[: FRAME * 2]
                if voice:
                    v = np.frombuffer(voice, dtype="<i2")
                    mic[: v.size] += v
                    self._voice_total += len(voice)
                    self.voice_sent.append((time.monotonic(), self._voice_total))
                if self.noise_rms:
                    mic += self._rng.standard_normal(FRAME) * self.noise_rms
                if self.echo_line is not None:
                    self.echo_line += played
                    back = np.frombuffer(bytes(self.echo_line[: FRAME * 2]), dtype="<i2")
                    del self.echo_line[: FRAME * 2]
                    mic += back * self.echo_gain
                pcm = mic.clip(-32768, 32767).astype("<i2").tobytes()
                payload = base64.b64encode(pcm16_to_g711(pcm, "g711_ulaw")).decode()
                await self.send(
                    {
                        "event": "media",
                        "sequenceNumber": str(seq + 1),
                        "streamSid": self.sid,
                        "media": {
                            "track": "inbound",
                            "chunk": str(seq),
                            "timestamp": str(seq * 20),
                            "payload": payload,
                        },
                    }
                )
                delay = t0 + seq * 0.02 - time.monotonic()
                await asyncio.sleep(max(0.0, delay))

    async def wait(self, cond: Any, within: float) -> None:
        deadline = time.monotonic() + within * UNIT
        while not cond():
            if time.monotonic() > deadline:
                raise TimeoutError("condition not met in time")
            await asyncio.sleep(0.02)


class SendAfterDrop:
    """Server-side patch: once armed, the server's third media send to a call that had none
    before arming waits until the server has seen that caller drop, then runs for real and
    fails as a send to a vanished Twilio does. A caller that drops after two media chunks
    then meets the race of a call dropped mid-send every time. Calls that got media before
    arming are not counted: a call dropped just before, whose last sends the server makes
    late on a loaded machine, would otherwise take the count, and the new call's first
    send would be the one held, so it never got the two chunks it waits for."""

    def __init__(self, monkeypatch: Any, *, armed: bool = False) -> None:
        from duplex_server.transports.twilio_out import TwilioOut
        from duplex_server.transports.twilio_wire import Outbound

        self.armed = armed
        self.held = 0  # sends held, then failed
        self._media = 0
        #: calls (attachments) sent media while unarmed; weak: an ended call's id may be reused
        self._before: weakref.WeakSet[Any] = weakref.WeakSet()
        real = TwilioOut.send

        async def send(att: TwilioOut, obj: Outbound) -> None:
            if obj.event == "media" and not self.armed:
                self._before.add(att)
            elif self.armed and obj.event == "media" and att not in self._before:
                self._media += 1
                if self._media == 3:
                    self.armed, self._media = False, 0
                    self.held += 1
                    for _ in range(1000):  # (10 s at most)
                        if att.ws.client_state == WebSocketState.DISCONNECTED:
                            break
                        await asyncio.sleep(0.01)
            await real(att, obj)

        monkeypatch.setattr(TwilioOut, "send", send)
