"""The workload of the simulated-GPU ladder (bench/gpu_sim.py): sessions that speak like people
(and miss like them), answers that get interrupted, batch speech beside them.

* **Speech-like audio.** Each turn is one or two phrases of voiced sound (a harmonic complex
  on a gliding pitch of 95-230 Hz, its loudness moving at a syllable rate of 3.5-5.5 Hz but
  never dropping to silence inside a phrase), 0.7-2.4 s each, then silence. Every turn's
  audio is different (the seed is the session's and the turn's).
* **Wrong pause guesses.** ``wrong_pct`` of the turns have a pause of 220-380 ms between their
  two phrases: longer than the server's pause guess (``input.pause`` after 64-96 ms of
  silence), shorter than the 500 ms that ends the turn. The engine guesses there and may
  answer ahead (a draft); the speech that resumes makes both wrong (the simulated ASR's words
  depend on the audio it heard, so the guess does not match the turn).
* **Barge-ins.** ``bargein_pct`` of the answers are interrupted: 0.4-1.5 s into the answer
  the session starts its next turn over it; the server cancels the answer
  (``response.done`` ``cancelled``) and answers the new turn.
* **Batch speech.** ``/v1/audio/speech`` requests (raw PCM, streamed) of 8-24 words arrive
  at ``batch_rps`` (Poisson) beside the sessions; first audio = the first body bytes.

Measured at the client: commit -> first audio (``input_audio_buffer.committed`` -> the
answer's first ``response.output_audio.delta``), last voiced frame -> first audio, playback
underruns (a chunk that arrives after the audio before it has played out, 10 ms of slack;
an answer is played in real time from its first chunk, until it is interrupted).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
import websockets

RATE = 24000  # the session's input and output rate (pcm16)
FRAME = RATE // 50 * 2  # 20 ms of PCM16
SLACK_S = 0.010
WORDS = (
    "the quick answer to your question is that we will meet again next week at the station "
    "near the old market where the trains leave every hour for the coast and the hills"
).split()


@dataclass(frozen=True)
class Turn:
    frames: list[bytes]  # 20 ms PCM16 frames: speech, pauses, trailing silence
    voiced_end: int  # index of the frame after the last voiced one
    paused: bool  # it has a pause inside (a wrong guess to be)


def _phrase(rng: random.Random, seconds: float) -> np.ndarray:
    n = int(seconds * RATE)
    t = np.arange(n) / RATE
    f0 = rng.uniform(95, 230) * (1 + 0.12 * np.sin(2 * np.pi * rng.uniform(0.3, 0.8) * t))
    phase = 2 * np.pi * np.cumsum(f0) / RATE
    voice = sum(np.sin(k * phase) / k for k in range(1, 7))
    syllables = 0.7 + 0.3 * np.sin(2 * np.pi * rng.uniform(3.5, 5.5) * t)  # never silent
    ramp = np.minimum(1.0, np.minimum(t, t[-1] - t) / 0.02)
    return voice * syllables * ramp * 0.18 * rng.uniform(0.7, 1.0)


def make_turn(seed: int, wrong_pct: float) -> Turn:
    rng = random.Random(seed)
    paused = rng.random() * 100 < wrong_pct
    parts = [_phrase(rng, rng.uniform(0.7, 1.6 if paused else 2.4))]
    if paused:
        parts.append(np.zeros(int(rng.uniform(0.22, 0.38) * RATE)))
        parts.append(_phrase(rng, rng.uniform(0.7, 1.6)))
    voiced = np.concatenate(parts)
    tail = np.zeros(int(0.8 * RATE))
    pcm = (np.clip(np.concatenate([voiced, tail]), -1, 1) * 32767).astype("<i2").tobytes()
    frames = [pcm[i : i + FRAME] for i in range(0, len(pcm), FRAME)]
    return Turn(frames, math.ceil(len(voiced) / (RATE // 50)), paused)


@dataclass
class Figures:
    ttfa_s: list[float] = field(default_factory=list)  # commit -> first audio
    ttfa_voice_s: list[float] = field(default_factory=list)  # last voiced frame -> first audio
    underruns: int = 0
    late_s: list[float] = field(default_factory=list)  # how late each underrun's chunk was
    answers: int = 0
    paused_turns: int = 0
    bargeins: int = 0  # answers this client interrupted that ended cancelled
    failed: list[str] = field(default_factory=list)
    batch_first_s: list[float] = field(default_factory=list)
    batch_requests: int = 0
    batch_failed: list[str] = field(default_factory=list)


def audio_s(delta_b64: str) -> float:
    n = len(delta_b64) * 3 // 4 - delta_b64[-2:].count("=")
    return n / 2 / RATE


class Listener:
    """Reads a session's events: each answer's commit, first audio, playback and end, by
    response id (an interrupted answer's last events come after its successor began)."""

    def __init__(self, fig: Figures) -> None:
        self.fig = fig
        self.commit = 0.0  # the last input_audio_buffer.committed
        self.voiced_end = 0.0  # the last voiced frame sent (the sender sets it)
        self.current: str | None = None  # the answer now awaited
        self.t_commit = self.t_voice = self.first = self.played_until = 0.0
        self.interrupted: set[str] = set()
        self.started = asyncio.Event()  # the awaited answer's first audio came
        self.done = asyncio.Event()  # ... and it ended

    def expect(self, interrupt: bool = False) -> None:
        """The next answer is awaited (``interrupt``: the current one is being spoken over)."""
        if interrupt and self.current is not None:
            self.interrupted.add(self.current)
        self.current = None
        self.started.clear()
        self.done.clear()

    async def run(self, ws: Any) -> None:
        fig = self.fig
        async for raw in ws:
            ev = json.loads(raw)
            kind = ev["type"]
            now = time.monotonic()
            if kind == "input_audio_buffer.committed":
                self.commit = now
            elif kind == "response.created":
                self.current = ev["response"]["id"]
                self.t_commit, self.t_voice, self.first = self.commit, self.voiced_end, 0.0
            elif kind == "response.output_audio.delta" and ev.get("response_id") == self.current:
                dur = audio_s(ev["delta"])
                if not self.first:
                    self.first = now
                    if self.t_commit:
                        fig.ttfa_s.append(now - self.t_commit)
                    if self.t_voice:
                        fig.ttfa_voice_s.append(now - self.t_voice)
                    self.played_until = now + dur
                    self.started.set()
                else:
                    if now > self.played_until + SLACK_S:
                        fig.underruns += 1
                        fig.late_s.append(now - self.played_until)
                    self.played_until = max(self.played_until, now) + dur
            elif kind == "response.done":
                rid = ev["response"]["id"]
                status = ev["response"]["status"]
                if rid in self.interrupted:
                    self.interrupted.discard(rid)
                    fig.bargeins += status == "cancelled"
                elif status != "completed":
                    fig.failed.append(f"{status}: {ev['response'].get('status_details')}")
                fig.answers += 1
                if rid == self.current:
                    self.done.set()


async def _send(ws: Any, frames: list[bytes], voiced_end: int, lst: Listener) -> None:
    t0 = time.monotonic()
    for i, frame in enumerate(frames):
        await ws.send(frame)
        if i == voiced_end - 1:
            lst.voiced_end = time.monotonic()
        await asyncio.sleep(max(0.0, t0 + (i + 1) * 0.02 - time.monotonic()))


async def session(
    addr: str, until: float, fig: Figures, seed: int, wrong_pct: float, bargein_pct: float
) -> None:
    rng = random.Random(seed)
    async with websockets.connect(f"ws://{addr}/v1/realtime", max_size=None) as ws:
        while json.loads(await ws.recv())["type"] != "session.created":
            pass
        td = {"type": "server_vad", "silence_duration_ms": 500}
        await ws.send(json.dumps({"type": "session.update", "session": {"turn_detection": td}}))
        lst = Listener(fig)
        reader = asyncio.create_task(lst.run(ws))
        try:
            await asyncio.sleep(rng.uniform(0.0, 10.0))  # spread the sessions' turns
            n = 0
            barge = False
            while time.monotonic() < until:
                turn = make_turn(seed * 1000 + n, wrong_pct)
                n += 1
                fig.paused_turns += turn.paused
                start = time.monotonic()
                lst.expect(interrupt=barge)
                await _send(ws, turn.frames, turn.voiced_end, lst)
                await asyncio.wait_for(lst.started.wait(), 30.0)
                barge = rng.random() * 100 < bargein_pct
                if barge:  # speak over the answer: the next turn starts soon
                    await asyncio.sleep(rng.uniform(0.4, 1.5))
                    continue
                await asyncio.wait_for(lst.done.wait(), 60.0)
                await asyncio.sleep(max(0.0, lst.played_until - time.monotonic()))  # hear it
                await asyncio.sleep(max(0.0, start + rng.uniform(8.0, 12.0) - time.monotonic()))
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)


async def batch_speech(addr: str, until: float, rps: float, fig: Figures, seed: int) -> None:
    """Poisson arrivals of streamed ``/v1/audio/speech`` requests until ``until``."""
    if rps <= 0:
        return
    rng = random.Random(seed)
    url = f"http://{addr}/v1/audio/speech"
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=limits) as client:

        async def one() -> None:
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 24)))
            body = {"model": "x", "input": words.capitalize() + ".", "response_format": "pcm"}
            t0 = time.monotonic()
            fig.batch_requests += 1
            try:
                async with client.stream("POST", url, json=body) as resp:
                    if resp.status_code != 200:
                        await resp.aread()
                        fig.batch_failed.append(f"HTTP {resp.status_code}: {resp.text[:120]}")
                        return
                    first = True
                    async for chunk in resp.aiter_bytes():
                        if first and chunk:
                            fig.batch_first_s.append(time.monotonic() - t0)
                            first = False
            except httpx.HTTPError as exc:
                fig.batch_failed.append(repr(exc))

        tasks: list[asyncio.Task[None]] = []
        while (now := time.monotonic()) < until:
            tasks.append(asyncio.create_task(one()))
            await asyncio.sleep(min(rng.expovariate(rps), max(0.0, until - now)))
        await asyncio.gather(*tasks)
