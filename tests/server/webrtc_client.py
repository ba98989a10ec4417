"""An aiortc client for tests: OpenAI's WebRTC flow against /v1/realtime/calls.

It POSTs its SDP offer (multipart with a session, or plain application/sdp), connects on
loopback, sends its microphone track (PCM it is told to say, else silence, 20 ms frames
at real time, Opus on the wire; with ``mic.echo`` the server's audio fed back and line
noise), records the server's audio frames with their arrival time and the JSON events of
the ``oai-events`` data channel.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

import httpx
import numpy as np
from aiortc import (
    MediaStreamTrack,
    RTCConfiguration,
    RTCPeerConnection,
    RTCSessionDescription,
)
from aiortc.mediastreams import MediaStreamError
from av import AudioFrame

from duplex_server.transports.webrtc_peer import lean_jitter_buffer
from tests.server.harness import UNIT

RATE = 48000
FRAME = 960


class MicTrack(MediaStreamTrack):
    """The microphone: what it is told to say, plus (``echo``) the server's audio fed back
    and line noise, a speakerphone."""

    kind = "audio"

    def __init__(self) -> None:
        super().__init__()
        self.say = bytearray()
        self._start = 0.0
        self._pts = 0
        #: (time sent, voice bytes sent so far) for each frame that carried voice
        self.voice_sent: list[tuple[float, int]] = []
        self._voice_total = 0
        self.echo_line: bytearray | None = None  # the server's audio, delayed
        self.echo_gain = 0.5
        self.noise_rms = 0.0
        self._rng = np.random.default_rng(0)

    def echo(self, delay_ms: float, gain: float, noise_rms: float = 0.0, seed: int = 0) -> None:
        """Feed the server's audio back ``delay_ms`` later, ``gain`` times as loud, with
        white line noise of ``noise_rms`` (PCM16)."""
        self.echo_line = bytearray(int(RATE * delay_ms / 1000) * 2)
        self.echo_gain, self.noise_rms = gain, noise_rms
        self._rng = np.random.default_rng(seed)

    def heard(self, pcm: bytes) -> None:
        """The server's audio as played (PCM16 mono at ``RATE``): its echo, later."""
        if self.echo_line is not None and len(self.echo_line) < RATE * 4:
            self.echo_line += pcm

    async def recv(self) -> AudioFrame:
        if self._pts:
            wait = self._start + self._pts / RATE - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
        else:
            self._start = time.monotonic()
        pcm = bytes(self.say[: FRAME * 2])
        del self.say[: FRAME * 2]
        if pcm:
            self._voice_total += len(pcm)
            self.voice_sent.append((time.monotonic(), self._voice_total))
        pcm += b"\x00" * (FRAME * 2 - len(pcm))
        if self.echo_line is not None:
            back = bytes(self.echo_line[: FRAME * 2])
            del self.echo_line[: FRAME * 2]
            back += b"\x00" * (FRAME * 2 - len(back))
            mic = np.frombuffer(pcm, dtype="<i2").astype(np.float64)
            mic += np.frombuffer(back, dtype="<i2") * self.echo_gain
            mic += self._rng.standard_normal(FRAME) * self.noise_rms
            pcm = mic.clip(-32768, 32767).astype("<i2").tobytes()
        frame = AudioFrame(format="s16", layout="mono", samples=FRAME)
        frame.planes[0].update(pcm)
        frame.pts = self._pts
        frame.sample_rate = RATE
        self._pts += FRAME
        return frame


#: packets a browser-like listener holds before it plays (``RtcClient(browser_jitter=True)``):
#: Chromium's NetEq on loopback holds ~30 ms (bench/browser_jitter.py); aiortc's own buffer
#: holds 4 (80 ms), so a listener on it hears every stop 40-50 ms later than a browser would.
#: 2 packets (40 ms) is the nearest aiortc setting at or above the browser's.
BROWSER_PREFETCH = 2


class RtcClient:
    def __init__(self, *, browser_jitter: bool = False) -> None:
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        self.mic = MicTrack()
        self.events: list[tuple[float, dict[str, Any]]] = []
        self.frames: list[tuple[float, float]] = []  # (arrival time, RMS) of server audio
        self.location = ""
        self._tasks: list[asyncio.Task[None]] = []
        self.channel = self.pc.createDataChannel("oai-events")
        self.channel.on("message", self._on_message)
        transceiver = self.pc.addTransceiver(self.mic, direction="sendrecv")
        if browser_jitter and not lean_jitter_buffer(transceiver.receiver, BROWSER_PREFETCH):
            raise RuntimeError("aiortc's jitter buffer was not found: cannot listen as a browser")
        self.pc.on("track", self._on_track)

    def _on_message(self, message: str) -> None:
        self.events.append((time.monotonic(), json.loads(message)))

    def _on_track(self, track: MediaStreamTrack) -> None:
        self._tasks.append(asyncio.create_task(self._read(track)))

    async def _read(self, track: MediaStreamTrack) -> None:
        with contextlib.suppress(MediaStreamError):
            while True:
                frame = await track.recv()
                data = frame.to_ndarray().astype(np.float64)
                self.frames.append((time.monotonic(), float(np.sqrt(np.mean(data**2)))))
                if self.mic.echo_line is not None:  # (packed s16: interleaved channels)
                    channels = len(frame.layout.channels)
                    mono = data.reshape(-1)[::channels]
                    self.mic.heard(mono.clip(-32768, 32767).astype("<i2").tobytes())

    async def connect(
        self,
        addr: str,
        session: dict[str, Any] | None = None,
        *,
        plain: bool = False,
        headers: dict[str, str] | None = None,
    ) -> httpx.Response:
        await self.pc.setLocalDescription(await self.pc.createOffer())
        sdp = self.pc.localDescription.sdp
        url = f"http://{addr}/v1/realtime/calls"
        async with httpx.AsyncClient(timeout=10 * UNIT) as http:
            if plain:
                hdrs = {"Content-Type": "application/sdp", **(headers or {})}
                resp = await http.post(url, content=sdp, headers=hdrs)
            else:
                files: dict[str, Any] = {"sdp": (None, sdp)}
                if session is not None:
                    files["session"] = (None, json.dumps(session))
                resp = await http.post(url, files=files, headers=headers)
        if resp.status_code == 201:
            self.location = resp.headers["location"]
            answer = RTCSessionDescription(sdp=resp.text, type="answer")
            await self.pc.setRemoteDescription(answer)
        return resp

    async def hangup(self, addr: str) -> int:
        async with httpx.AsyncClient(timeout=10 * UNIT) as http:
            resp = await http.post(f"http://{addr}{self.location}/hangup")
        return resp.status_code

    def send(self, event: dict[str, Any]) -> None:
        self.channel.send(json.dumps(event))

    def kinds(self) -> list[str]:
        return [e["type"] for _, e in self.events]

    async def until(self, kind: str, within: float = 10.0, after: int = 0) -> dict[str, Any]:
        """The first event of ``kind`` at index >= ``after`` (waiting for it)."""
        deadline = time.monotonic() + within * UNIT
        while True:
            for _, event in self.events[after:]:
                if event["type"] == kind:
                    return event
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {kind} in time; got {self.kinds()}")
            await asyncio.sleep(0.02)

    def time_of(self, event: dict[str, Any]) -> float:
        return next(t for t, e in self.events if e is event)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.pc.close()
