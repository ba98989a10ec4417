"""One trial of bench/turn_taking.py on each transport: a live answer, a sound laid over it,
and what the far end saw and heard.

Each driver opens a session of its own, gets a spoken answer going (a text question on the
WebSocket and WebRTC, a spoken one on a Twilio call), waits ``offset_s`` of the answer's
audio, says the clip (the far end's microphone: 20 ms frames at real time), listens
``LISTEN_S`` more and hangs up. The far ends are the tests' (tests/server/twilio_sim.py: a
Twilio peer that plays at real time and echoes marks as it plays; tests/server/
webrtc_client.py: aiortc), so the same code the tests trust does the talking.

Times (one monotonic clock): the clip's **onset** is when the microphone frame holding its
first voiced sample was sent, less how far into that frame it lies; its **end** likewise for
its last voiced sample. The answer's audio **stops** for the listener at: the first
``output_audio_buffer.paused`` / ``.cleared`` or ``response.done{cancelled}`` a WebSocket
client is sent; the first silent frame of a run of 10 (0.2 s) on the WebRTC track, as a
browser plays it (the far end's jitter buffer holds 2 packets, 40 ms, as a browser's about
does: bench/browser_jitter.py; aiortc's default 4 would add 40 ms no browser adds); the
``clear`` Twilio is sent (it stops playing there). It **resumes** at
``output_audio_buffer.resumed`` (WebSocket, WebRTC: its audio follows on the track) or at the
first media of the same item after the clear (Twilio). An answer **ended** when it was
cancelled or cleared and not resumed.

A trial is **void** (retried with the same sound) when its answer was over too soon to
judge it: an answer that paused must play on to 1 s after the sound's end (its resume must
be seen); one that never paused or stopped, to ``VERDICT_S`` after it (in ``confirm`` every
stop follows a pause at the onset, so an answer still playing then was not cut: a cough
the VAD does not take for speech is a judged trial, not a void one).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import websockets
from turn_taking_clips import Clip

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.server.twilio_sim import TwilioSim
from tests.server.webrtc_client import RtcClient

LISTEN_S = 3.0  # after the clip's end
FRAME_MS = 20
SILENT_RMS = 60.0  # a decoded Opus frame of silence stays far below this
SILENT_RUN = 10
ANSWER_TIMEOUT_S = 30.0
#: an answer playing this long after the sound's end, never paused, was not cut by it (the
#: VAD's onset comes ~0.1 s into speech)
VERDICT_S = 0.3


@dataclass(frozen=True)
class Echo:
    """The answer fed back into the microphone: ``delay_ms`` late, ``gain_db``, with white
    line noise of ``noise_rms`` (PCM16)."""

    delay_ms: float
    gain_db: float
    noise_rms: float = 60.0

    @property
    def gain(self) -> float:
        return float(10 ** (self.gain_db / 20))


@dataclass
class Outcome:
    onset: float | None = None
    end: float | None = None
    stopped_at: float | None = None  # the answer's audio stopped for the listener
    paused: bool = False
    ended: bool = False  # cancelled or cleared (and not resumed)
    resumed_at: float | None = None
    transcript: str | None = None  # the user turn that followed (WebSocket, WebRTC)
    void: str = ""  # why the trial could not be judged (no answer, answer too short)
    events: list[str] = field(default_factory=list)

    def trace(self, events: list[tuple[float, dict[str, Any]]]) -> None:
        """The events that tell the story, timed from the onset (``--trace``)."""
        zero = self.onset or 0.0
        keep = ("output_audio_buffer.", "input_audio_buffer.speech", "response.done")
        for t, e in events:
            kind = e["type"]
            if t < zero - 0.5:
                continue
            if kind.startswith(keep) or "transcription" in kind:
                detail = e.get("delta") or e.get("transcript") or ""
                if kind == "response.done":
                    detail = e["response"]["status"]
                self.events.append(f"{(t - zero) * 1000:+.0f} {kind} {detail}".strip())

    def row(self) -> dict[str, Any]:
        def ms(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None else round((a - b) * 1000, 1)

        return {
            "heard_stop_ms": ms(self.stopped_at, self.onset),
            "paused": self.paused,
            "ended": self.ended,
            "resumed": self.resumed_at is not None,
            "resume_after_end_ms": ms(self.resumed_at, self.end),
            "transcript": self.transcript,
            "void": self.void,
            "trace": self.events,
        }


def _frame_time(sent: list[tuple[float, int]], byte: int, rate: int) -> float | None:
    """When microphone byte ``byte`` was spoken: from (frame sent, bytes so far) pairs."""
    for t, total in sent:
        if total > byte:
            return t - (total - byte) / (2 * rate)
    return None


# ---------------------------------------------------------------------------- WebSocket
async def websocket(addr: str, clip: Clip | None, offset_s: float, echo: Echo | None) -> Outcome:
    """The client plays (it is told to pause, resume and clear); ``confirm`` opted in."""
    rate = 16000
    frame = rate * FRAME_MS // 1000 * 2
    silence = b"\0" * frame
    out = Outcome()
    events: list[tuple[float, dict[str, Any]]] = []
    session = {
        "output_modalities": ["audio"],
        "max_output_tokens": 80,
        "audio": {
            "input": {
                "format": {"type": "audio/pcm", "rate": rate},
                "turn_detection": {"type": "server_vad", "interrupt_mode": "confirm"},
            }
        },
    }
    from turn_taking_clips import QUESTION

    async with websockets.connect(f"ws://{addr}/v1/realtime", max_size=None) as ws:
        await ws.send(json.dumps({"type": "session.update", "session": session}))
        item = {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": QUESTION}],
        }
        await ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
        await ws.send(json.dumps({"type": "response.create"}))
        audio_ms = [0.0]

        async def reader() -> None:
            async for raw in ws:
                if isinstance(raw, bytes):
                    continue
                e = json.loads(raw)
                events.append((time.monotonic(), e))
                if e["type"] == "response.output_audio.delta":
                    audio_ms[0] += len(base64.b64decode(e["delta"])) / 48.0  # 24 kHz

        task = asyncio.create_task(reader())
        t = time.monotonic()
        sent: list[tuple[float, int]] = []
        try:
            first = await _first(events, "response.output_audio.delta", t, lambda: None)
            if first is None:
                out.void = "no answer"
                return out
            pcm = b"" if clip is None else clip.pcm(rate)
            start = first + offset_s
            total = 0
            deadline = start + (len(pcm) / 2 / rate) + LISTEN_S
            left_ms: float | None = None  # the answer's audio still to play at the start
            t = time.monotonic()
            while time.monotonic() < deadline:
                now = time.monotonic()
                if now >= start and left_ms is None:
                    left_ms = audio_ms[0] - (now - first) * 1000
                if now >= start and total < len(pcm):
                    chunk = pcm[total : total + frame]
                    total += len(chunk)
                    sent.append((time.monotonic(), total))
                    await ws.send(chunk + silence[len(chunk) :])
                else:
                    await ws.send(silence)
                t += FRAME_MS / 1000
                await asyncio.sleep(max(0.0, t - time.monotonic()))
            done = [t for t, e in events if e["type"] == "response.done" and t < start]
            if left_ms is not None and left_ms < 200 and done:
                out.void = "the answer was over"  # all of it sent, and played by the start
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if clip is not None:
        out.onset = _frame_time(sent, clip.at(rate, clip.first), rate)
        out.end = _frame_time(sent, clip.at(rate, clip.last), rate)
    _judge_events(out, events, start)
    out.trace(events)
    answer_done = any(e["type"] == "response.done" for _, e in events)
    if not out.ended and out.end is not None and answer_done:
        if first + audio_ms[0] / 1000 < out.end + (1.0 if out.paused else VERDICT_S):
            out.void = "the answer was over"  # it could not have been heard going on
    return out


async def _first(
    events: list[tuple[float, dict[str, Any]]], kind: str, since: float, tick: Any
) -> float | None:
    deadline = since + ANSWER_TIMEOUT_S
    while time.monotonic() < deadline:
        for t, e in events:
            if e["type"] == kind:
                return t
        tick()
        await asyncio.sleep(0.02)
    return None


def _judge_events(out: Outcome, events: list[tuple[float, dict[str, Any]]], start: float) -> None:
    """Pause, stop, resume and the next turn's transcript, from the session's events."""
    answer = next((e["response"]["id"] for _, e in events if e["type"] == "response.created"), None)
    user_items: set[str] = set()
    for t, e in events:
        kind = e["type"]
        if t < start:
            continue
        mine = e.get("response_id") == answer
        if kind == "output_audio_buffer.paused" and mine:
            out.paused = True
            out.stopped_at = out.stopped_at or t
        elif kind == "output_audio_buffer.resumed" and mine:
            out.resumed_at = t
            out.ended = False
        elif (kind == "output_audio_buffer.cleared" and mine) or (
            kind == "response.done"
            and e["response"]["id"] == answer
            and e["response"]["status"] == "cancelled"
        ):
            out.stopped_at = out.stopped_at or t
            out.ended = True
        elif kind == "input_audio_buffer.committed":
            user_items.add(e["item_id"])
        elif kind == "conversation.item.input_audio_transcription.completed":
            if e["item_id"] in user_items and out.transcript is None:
                out.transcript = e["transcript"]
    if out.ended:
        out.resumed_at = None


# ---------------------------------------------------------------------------- WebRTC
async def webrtc(addr: str, clip: Clip | None, offset_s: float, echo: Echo | None) -> Outcome:
    """The server plays on its track (``interrupt_mode`` auto: confirm). With ``echo`` the
    far end has no echo canceller of its own (a browser's getUserMedia would remove the
    echo before sending it; a phone gateway or a device may not), so the session turns the
    server's on, as such a client should (``audio.input.echo_cancellation``: off by default
    on WebRTC, on on Twilio)."""
    from turn_taking_clips import QUESTION

    rate = 48000
    out = Outcome()
    client = RtcClient(browser_jitter=True)
    session: dict[str, Any] = {"type": "realtime", "max_output_tokens": 80}
    if echo is not None:
        session["audio"] = {"input": {"echo_cancellation": True}}
    try:
        resp = await client.connect(addr, session)
        if resp.status_code != 201:
            out.void = f"call refused: {resp.status_code}"
            return out
        await client.until("session.updated", within=15)
        if echo is not None:
            client.mic.echo(echo.delay_ms, echo.gain, echo.noise_rms)
        item = {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": QUESTION}],
        }
        client.send({"type": "conversation.item.create", "item": item})
        client.send({"type": "response.create"})
        started = await client.until("output_audio_buffer.started", within=ANSWER_TIMEOUT_S)
        start = client.time_of(started) + offset_s
        await asyncio.sleep(max(0.0, start - time.monotonic()))
        pcm = b"" if clip is None else clip.pcm(rate)
        client.mic.say += pcm
        await asyncio.sleep(len(pcm) / 2 / rate + LISTEN_S)
        if clip is not None:
            out.onset = _frame_time(client.mic.voice_sent, clip.at(rate, clip.first), rate)
            out.end = _frame_time(client.mic.voice_sent, clip.at(rate, clip.last), rate)
        # echo alone: from the answer's first audio (its echo can pause it any time)
        _judge_events(out, client.events, start if clip is not None else client.time_of(started))
        out.trace(client.events)
        stops = [t for _, t in _silent_runs(client.frames, start)]
        if out.stopped_at is not None and stops:  # the audio itself, where it stopped
            # not before the pause is told: a silence that began earlier is a gap between
            # the answer's sentences, not the stop (the pause's own silence comes after it)
            near = [s for s in stops if s >= out.stopped_at]
            out.stopped_at = near[0] if near else out.stopped_at
        done = [e for _, e in client.events if e["type"] == "output_audio_buffer.stopped"]
        if done and clip is not None and not out.ended and not out.paused:
            last = max(t for t, e in client.events if e["type"] == "output_audio_buffer.stopped")
            if out.end is not None and last < out.end + VERDICT_S:
                out.void = "the answer was over"
    except TimeoutError as exc:
        out.void = f"timeout: {exc}"[:120]
    finally:
        await client.close()
    return out


def _silent_runs(frames: list[tuple[float, float]], since: float) -> list[tuple[float, float]]:
    """(last loud frame, first silent frame) of each run of ``SILENT_RUN`` silent frames
    after a loud one, from ``since``."""
    out = []
    loud_at: float | None = None
    run: list[float] = []
    for t, rms in frames:
        if t < since:
            continue
        if rms >= SILENT_RMS:
            loud_at, run = t, []
        elif loud_at is not None:
            run.append(t)
            if len(run) == SILENT_RUN:
                out.append((loud_at, run[0]))
                loud_at = None
    return out


# ---------------------------------------------------------------------------- Twilio
async def twilio(
    addr: str, clip: Clip | None, offset_s: float, echo: Echo | None, question: bytes
) -> Outcome:
    """A phone call: the caller asks ``question`` (PCM16 8 kHz) and talks over the answer."""
    rate = 8000
    out = Outcome()
    kw: dict[str, Any] = {}
    if echo is not None:
        kw = {"echo_delay_ms": echo.delay_ms, "echo_gain": echo.gain, "noise_rms": echo.noise_rms}
    session = {"max_output_tokens": 80}
    async with TwilioSim.call(addr, {"session": json.dumps(session)}, **kw) as sim:
        sim.speak(question)
        with contextlib.suppress(TimeoutError):
            await sim.wait(lambda: sim.played > 0 and bool(sim.marks_in), ANSWER_TIMEOUT_S)
        if sim.played == 0 or not sim.marks_in:
            out.void = "no answer"
            await sim.stop()
            return out
        first_item = sim.marks_in[0].rpartition(":")[0]
        start = time.monotonic() + offset_s
        await asyncio.sleep(offset_s)
        said = len(sim.voice_sent)
        base = sim.voice_sent[-1][1] if sim.voice_sent else 0  # the question's bytes
        pcm = b"" if clip is None else clip.pcm(rate)
        sim.speak(pcm)
        await asyncio.sleep(len(pcm) / 2 / rate + VERDICT_S)
        playing = len(sim.playout) > 0  # the answer still played after the sound
        await asyncio.sleep(LISTEN_S - VERDICT_S)
        await sim.stop()
    sent = [(t, total - base) for t, total in sim.voice_sent[said:]]  # the clip's bytes
    if clip is not None:
        out.onset = _frame_time(sent, clip.at(rate, clip.first), rate)
        out.end = _frame_time(sent, clip.at(rate, clip.last), rate)
    clears = [
        t for t, m in zip(sim.received_at, sim.received, strict=True) if m["event"] == "clear"
    ]
    if clip is not None:  # echo alone: from the answer's first audio
        clears = [t for t in clears if t >= start]
    if clears:
        out.stopped_at = clears[0]
        out.paused = True
        after = [
            t
            for t, m in zip(sim.received_at, sim.received, strict=True)
            if t > clears[-1]
            and m["event"] == "mark"
            and m["mark"]["name"].startswith(first_item + ":")
        ]
        if after:
            out.resumed_at = after[0]
        else:
            out.ended = True
    if clip is not None and not clears and not playing:
        out.void = "the answer was over"
    return out
