"""Soak: N concurrent sessions for M minutes against the real server; is memory flat, and
does every session's slot come back?

Starts ``duplex-server serve`` on loopback and runs N session loops. Each loop opens a
session, does a few back-to-back spoken turns (a tone for the test stage, tests/data/
beckett.wav for the CPU default), each turn one of:

* ``turn``: speak, wait for the answer (``response.done{completed}``);
* ``cancel``: barge in with ``response.cancel`` after the first audio of the answer;
* ``voice``: barge in by talking over the answer (its ``response.done``, then the answer to
  the interruption);
* ``drop``: drop the socket abruptly mid-answer, resume with the last seq received and read
  the rest (every ``server_event_seq`` must follow the previous one: nothing lost or
  duplicated);
* ``chaos`` (``--chaos``, test stage): a turn that kills the LLM stage's worker thread
  (the batching runtime's real crash and restart path); that turn, and any other session's
  turn in the same batch, must end ``response.done{failed}`` (``worker_died``), and the
  session goes on with the next turn;

then ends the session with ``session.close`` (most), a plain close 1000 without it, or an
abrupt drop it never resumes (the server must end it after ``disconnect_grace_s``). A session
that fails (below) closes its sockets (1000), as a client that gives up would.

``--client realtime`` (the default on real models) behaves like a voice client: it streams
its speech in real time (100 ms frames every 100 ms) and, after an answer, waits until the
answer's audio has played (``audio_ms`` from its first chunk) before the next turn;
``burst`` (the default on the test stage, whose TTS is paced by ``--pace``) sends speech at
once and starts the next turn at once. An answer cut at ``max_output_tokens``
(``incomplete``) is an answer. The wait from the end of the user's speech to the first
audio of the answer is reported (``first_audio_s``: p50, p95, max): on an overloaded
server turns queue, and this is what a user would wait. Every
``--sample-s`` it samples the server's RSS (the process and its children, /proc) and its
session gauges (``/health``, ``duplex_sessions{state}``, ``duplex_engine_sessions{state}``,
``duplex_session_bytes{part}``). At the end it waits out the grace period and reads what is
left.

Prints the RSS slope after warm-up (MB per hour, least squares), leftover sessions (live in
the front end) and slots (engine sessions in any state), and failures (a timeout, an
unexpected error or status, a seq gap or a refused resume; ``failure_kinds``: timeout,
refused (no session slot: ``resource_exhausted``), other). Writes a PNG of RSS and sessions
over time (``--plot``) and ``--json PATH`` with ``rss_slope_mb_per_h``, ``leftover_sessions``,
``leftover_slots``, ``failures`` and the details. The machine's load average is recorded:
read the figures with it.

    python bench/soak.py [--minutes M] [--sessions N] [--config C] [--json PATH]
        [--plot PNG] [--warmup-min W] [--grace S] [--chaos] [--pace X] [--seed N]
        [--client auto|realtime|burst] [--timeout S] [--server-log PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import websockets
import yaml
from serverproc import ROOT, running_server

RATE = 24000
CHAOS_WORD = "SOAKCHAOS"
TERMINAL = {"completed", "cancelled", "incomplete", "failed"}
# an answered turn: completed, or cut at max_output_tokens (incomplete, reason
# max_output_tokens: the whole answer the server was asked for; SmolLM2 often runs that long)
ANSWERED = {"completed", "incomplete"}


# ---------------------------------------------------------------------------- config
def soak_config(
    src: Path, tmp: Path, grace_s: float | None, chaos: bool, pace: float = 3.0
) -> tuple[Path, bool]:
    """The config the server runs: ``src``, with the test stage speaking in real time (so a
    drop or barge-in lands mid-answer) and, for ``--chaos``, an LLM on the batching runtime
    that crashes its worker on a marked turn. Returns (path, is the test stage)."""
    raw = yaml.safe_load(src.read_text())
    stages = raw["engine"]["stages"]
    test_stage = all(str(s.get("backend", "")).startswith("test") for s in stages.values())
    duplex = raw["engine"].setdefault("duplex", {})
    if grace_s is not None:
        duplex["disconnect_grace_s"] = grace_s
        duplex["reaper_interval_s"] = min(1.0, max(0.1, grace_s / 5))
    if test_stage:
        stages["tts"] = {"backend": "test", "options": {"realtime": True, "pace": pace}}
        if chaos:
            llm = stages["llm"].setdefault("options", {})
            stages["llm"]["backend"] = "test-batch"
            llm.pop("token_interval_s", None)
            llm.update({"crash_on": CHAOS_WORD, "step_s": 0.01})
    path = tmp / "soak.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path, test_stage


def tone(ms: float, hz: float = 300.0) -> bytes:
    t = np.arange(int(RATE * ms / 1000)) / RATE
    return (np.sin(2 * np.pi * hz * t) * 0.3 * 32767).astype("<i2").tobytes()


def silence(ms: float) -> bytes:
    return b"\0\0" * int(RATE * ms / 1000)


def speech_clip() -> bytes:
    """tests/data/beckett.wav at 24 kHz PCM16 (the CPU default's spoken question)."""
    import soundfile as sf
    import soxr

    data, rate = sf.read(ROOT / "tests" / "data" / "beckett.wav", dtype="float32")
    if data.ndim > 1:
        data = data.mean(axis=1)
    data = soxr.resample(data, rate, RATE)
    win = RATE // 100  # from the first speech (found by energy), 3 s of it
    rms = np.sqrt(np.convolve(data**2, np.ones(win) / win, mode="same"))
    start = int(np.argmax(rms > 0.1 * rms.max()))
    data = data[max(0, start - win) : start + 3 * RATE]
    return bytes((np.clip(data, -1, 1) * 32767).astype("<i2").tobytes())


# ---------------------------------------------------------------------------- one session
class Failure(Exception):
    """Something the soak counts as a failure (a timeout, a wrong event, a seq gap)."""


@dataclass
class Stats:
    turns: Counter[str] = field(default_factory=Counter)
    ends: Counter[str] = field(default_factory=Counter)
    failures: list[dict[str, str]] = field(default_factory=list)
    chaos_affected: int = 0
    sessions: int = 0
    first_audio_s: list[float] = field(default_factory=list)  # end of speech -> first audio
    silent_answers: int = 0  # answered with no audio (an LLM reply with nothing to speak)


class Conn:
    """One socket of a session: reads events in order and checks the seq continues."""

    def __init__(self, ws: Any, sess: SessionState, timeout: float, realtime: bool) -> None:
        self.ws, self.sess, self.timeout, self.realtime = ws, sess, timeout, realtime
        sess.sockets.append(ws)

    async def recv(self) -> dict[str, Any]:
        try:
            raw = await asyncio.wait_for(self.ws.recv(), self.timeout)
        except TimeoutError:
            raise Failure("timeout waiting for an event") from None
        except websockets.ConnectionClosed as exc:
            raise Failure(f"socket closed: {exc.rcvd}") from None
        event: dict[str, Any] = json.loads(raw)
        seq = event.get("server_event_seq", 0)
        if seq and event["type"] != "session.replaced":
            if seq != self.sess.last_seq + 1:
                raise Failure(f"seq {seq} after {self.sess.last_seq} ({event['type']})")
            self.sess.last_seq = seq
        if event["type"] == "error":
            code = event["error"]["code"]
            if code not in self.sess.tolerate:
                raise Failure(f"error {code}: {event['error'].get('message')}")
        return event

    async def until(self, kind: str) -> dict[str, Any]:
        while True:
            event = await self.recv()
            if event["type"] == kind:
                return event

    async def send(self, obj: dict[str, Any]) -> None:
        await self.ws.send(json.dumps(obj))

    async def speak(self, speech: bytes, tail: bytes) -> float:
        """``speech`` then ``tail`` (silence) in 100 ms binary frames; with ``realtime``, one
        every 100 ms (a microphone). Returns when the speech (not its tail) had been sent."""
        step = RATE // 10 * 2
        pcm, spoke = speech + tail, time.monotonic()
        t0 = time.monotonic()
        for n, i in enumerate(range(0, len(pcm), step)):
            await self.ws.send(pcm[i : i + step])
            if i + step >= len(speech) > i:
                spoke = time.monotonic()
            if self.realtime:
                await asyncio.sleep(max(0.0, t0 + (n + 1) * 0.1 - time.monotonic()))
        return spoke


@dataclass
class SessionState:
    session_id: str = ""
    token: str = ""
    resume_query: str = "?intent=resume"
    last_seq: int = 0
    sockets: list[Any] = field(default_factory=list)  # every socket opened, closed at the end
    # a cancel that crosses the end of its response gets this answer (documented)
    tolerate: set[str] = field(default_factory=lambda: {"response_cancel_not_active"})


class Driver:
    def __init__(
        self, addr: str, test_stage: bool, chaos: bool, timeout: float, realtime: bool = False
    ) -> None:
        self.addr, self.test_stage, self.chaos, self.timeout = addr, test_stage, chaos, timeout
        self.realtime = realtime  # a real client: speaks in real time, hears the answer out
        self.stats = Stats()
        self.question = tone(600) if test_stage else speech_clip()
        self.tail = silence(900 if test_stage else 1200)
        self.interrupt = tone(500, 250) if test_stage else speech_clip()[: RATE * 2 * 2]

    def url(self, query: str = "") -> str:
        return f"ws://{self.addr}/v1/realtime{query}"

    async def loop(self, idx: int, deadline: float, rng: random.Random) -> None:
        while time.monotonic() < deadline:
            self.stats.sessions += 1
            try:
                await self.session(rng, deadline)
            except Failure as exc:
                self.stats.failures.append({"session": str(idx), "what": str(exc)})
                await asyncio.sleep(1.0)
            except (OSError, websockets.WebSocketException) as exc:
                self.stats.failures.append({"session": str(idx), "what": repr(exc)})
                await asyncio.sleep(1.0)

    async def session(self, rng: random.Random, deadline: float) -> None:
        sess = SessionState()
        kinds = ["turn", "cancel", "voice", "drop", "chaos"]
        weights = [2.0, 1.0, 1.0, 2.0, 0.3 if self.chaos and self.test_stage else 0.0]
        ws = await websockets.connect(self.url(), max_size=None, open_timeout=self.timeout)
        conn = Conn(ws, sess, self.timeout, self.realtime)
        try:
            created = await conn.until("session.created")
            sess.session_id = created["session"]["id"]
            sess.token = created["resume_token"]
            sess.resume_query = "?" + created.get("resume_query", "intent=resume")
            if not self.test_stage:
                # the question (beckett.wav's first 3 s) holds three phrases with ~0.7 s
                # pauses: with the default 500 ms silence window each pause ends a turn, and
                # that turn's answer is cancelled (turn_detected) when the next phrase starts.
                # A 1 s window keeps the question one turn, as the soak means it.
                td = {"type": "server_vad", "silence_duration_ms": 1000}
                await conn.send(
                    {
                        "type": "session.update",
                        "session": {"audio": {"input": {"turn_detection": td}}},
                    }
                )
                await conn.until("session.updated")
            for _ in range(rng.randint(2, 5)):
                kind = rng.choices(kinds, weights)[0]
                conn = await self.turn(conn, kind, rng)
                self.stats.turns[kind] += 1
                await conn.send({"type": "session.event_ack", "seq": sess.last_seq})
                if time.monotonic() > deadline:
                    break
            end = rng.choices(["close", "plain", "abandon"], [0.7, 0.15, 0.15])[0]
            if end == "close":
                await conn.send({"type": "session.close"})
                await conn.until("session.closed")
                with contextlib.suppress(websockets.ConnectionClosed, TimeoutError):
                    await asyncio.wait_for(conn.ws.recv(), self.timeout)
                if conn.ws.close_code != 1000:
                    raise Failure(f"closed with {conn.ws.close_code} after session.closed")
            elif end == "plain":
                await conn.ws.close(1000)
            else:
                conn.ws.transport.abort()
            self.stats.ends[end] += 1
        finally:  # every socket of the session, a resumed one that failed included: a
            # client that gives up (a timeout) closes its socket, which ends the session
            for sock in sess.sockets:
                if sock.transport is not None and not sock.transport.is_closing():
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(sock.close(1000), 5.0)
                    if not sock.transport.is_closing():
                        sock.transport.abort()

    async def turn(self, conn: Conn, kind: str, rng: random.Random) -> Conn:
        if kind == "chaos":
            await conn.send(_text_item(f"{CHAOS_WORD} please crash"))
            await conn.send({"type": "response.create"})
            done = await conn.until("response.done")
            if not self._failed_by_chaos(done):
                raise Failure(f"chaos turn ended {done['response']['status']}")
            return conn
        spoke = await conn.speak(self.question, self.tail)
        delta = await self._first_delta(conn, spoke)
        if delta is None:  # no audio: failed by a crash (--chaos), or nothing to speak
            return conn
        rid = delta["response_id"]
        if kind == "turn":
            await self._listen(delta, await self._done(conn, rid, ANSWERED))
        elif kind == "cancel":
            await conn.send({"type": "response.cancel"})
            await self._done(conn, rid, ANSWERED | {"cancelled"})
        elif kind == "voice":
            spoke = await conn.speak(self.interrupt, self.tail)
            await self._done(conn, rid, ANSWERED | {"cancelled"})
            nxt = await self._first_delta(conn, spoke)
            if nxt is not None:
                await self._listen(nxt, await self._done(conn, nxt["response_id"], ANSWERED))
        else:  # drop mid-answer, then resume from the last seq received
            await asyncio.sleep(rng.uniform(0.0, 0.3))
            conn.ws.transport.abort()
            await asyncio.sleep(rng.uniform(0.05, 0.5))
            conn = await self.resume(conn.sess)
            await self._listen(delta, await self._done(conn, rid, ANSWERED))
        return conn

    async def resume(self, sess: SessionState) -> Conn:
        ws = await websockets.connect(
            self.url(sess.resume_query), max_size=None, open_timeout=self.timeout
        )
        conn = Conn(ws, sess, self.timeout, self.realtime)
        await conn.send(
            {
                "type": "session.resume",
                "session_id": sess.session_id,
                "resume_token": sess.token,
                "last_received_server_event_seq": sess.last_seq,
            }
        )
        while True:
            event = await conn.recv()
            if event["type"] == "session.resync_required":
                raise Failure("resync required after a short drop")
            if event["type"] == "session.resumed":
                sess.token = event["resume_token"]
                return conn
            if event["type"] == "response.done":
                conn.pending_done = event  # type: ignore[attr-defined]

    async def _first_delta(self, conn: Conn, spoke: float) -> dict[str, Any] | None:
        """The answer's first audio chunk (``spoke``: when the user's speech ended)."""
        while True:
            event = await conn.recv()
            if event["type"] == "response.output_audio.delta":
                event["_at"] = time.monotonic()
                self.stats.first_audio_s.append(event["_at"] - spoke)
                return event
            if event["type"] == "response.done":
                if self._failed_by_chaos(event):
                    return None
                resp = event["response"]
                if resp["status"] == "completed" or _reason(event) == "max_output_tokens":
                    self.stats.silent_answers += 1  # a reply with nothing to speak
                    return None
                raise Failure(f"response.done before its audio: {resp}")

    async def _done(self, conn: Conn, rid: str, ok: set[str]) -> dict[str, Any]:
        event: dict[str, Any] | None = getattr(conn, "pending_done", None)
        while event is None or event["response"]["id"] != rid:
            event = await conn.until("response.done")
        status = event["response"]["status"]
        if status not in ok and not self._failed_by_chaos(event):
            raise Failure(f"response {status} (expected {sorted(ok)}): {event['response']}")
        if status == "incomplete" and _reason(event) != "max_output_tokens":
            raise Failure(f"response incomplete: {event['response']}")
        return event

    async def _listen(self, first: dict[str, Any], done: dict[str, Any]) -> None:
        """A real client plays the answer before its user speaks again: wait until its
        audio, from its first chunk, has played (``realtime`` only)."""
        if not self.realtime:
            return
        audio_s = float(done["response"].get("audio_ms") or 0.0) / 1000.0
        await asyncio.sleep(max(0.0, first["_at"] + audio_s - time.monotonic()))

    def _failed_by_chaos(self, done: dict[str, Any]) -> bool:
        resp = done["response"]
        if not self.chaos or resp["status"] != "failed":
            return False
        err = (resp.get("status_details") or {}).get("error") or {}
        if "worker died" in str(err.get("message", "")) or err.get("code") == "worker_died":
            self.stats.chaos_affected += 1
            return True
        return False


def _reason(done: dict[str, Any]) -> str:
    return str((done["response"].get("status_details") or {}).get("reason", ""))


def _text_item(text: str) -> dict[str, Any]:
    content = [{"type": "input_text", "text": text}]
    return {
        "type": "conversation.item.create",
        "item": {"type": "message", "role": "user", "content": content},
    }


# ---------------------------------------------------------------------------- sampling
def rss_mb(pid: int) -> tuple[float, float]:
    """Resident memory of ``pid`` and of all its descendants (the partials decoder), MB
    (Linux /proc)."""
    own, total, todo, seen = 0, 0, [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        with contextlib.suppress(OSError, ValueError):
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
                    own = total if p == pid else own
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
    return own / 1024, (total - own) / 1024


_SAMPLE = re.compile(r'^(duplex_[a-z_]+)\{(\w+)="([^"]*)"\} ([0-9.e+-]+)$', re.M)


def scrape(addr: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://{addr}/health", timeout=10) as r:
        health = json.loads(r.read())
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, Any] = {"health_sessions": health.get("sessions", -1)}
    for name, _label, value, num in _SAMPLE.findall(text):
        if name in ("duplex_sessions", "duplex_engine_sessions", "duplex_session_bytes"):
            out.setdefault(name, {})[value] = float(num)
    return out


async def sampler(
    addr: str, pid: int, t0: float, every: float, stop: asyncio.Event, out: list[dict[str, Any]]
) -> None:
    while True:
        sample = await asyncio.to_thread(scrape, addr)
        sample["t_s"] = time.monotonic() - t0
        main, children = rss_mb(pid)
        sample["rss_mb"] = main + children
        sample["rss_children_mb"] = children
        out.append(sample)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every)
            return


def slope_mb_per_h(samples: list[dict[str, Any]], warmup_s: float) -> float:
    pts = [(s["t_s"], s["rss_mb"]) for s in samples if s["t_s"] >= warmup_s]
    if len(pts) < 3:
        return float("nan")
    t, rss = np.array(pts).T
    return float(np.polyfit(t / 3600.0, rss, 1)[0])


def plot(
    samples: list[dict[str, Any]], warmup_s: float, slope: float, path: Path, title: str
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = np.array([s["t_s"] for s in samples]) / 60
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    ax1.plot(t, [s["rss_mb"] for s in samples], label="server RSS (MB)")
    ax1.plot(t, [s["rss_children_mb"] for s in samples], ls=":", label="of which child processes")
    ax1.axvline(warmup_s / 60, color="grey", ls="--", label="end of warm-up")
    ax1.set_ylabel("MB")
    ax1.set_title(f"{title}: slope after warm-up {slope:+.1f} MB/h")
    ax1.legend(loc="lower right")
    states = sorted({k for s in samples for k in s.get("duplex_sessions", {})})
    for state in states:
        ax2.plot(t, [s.get("duplex_sessions", {}).get(state, 0) for s in samples], label=state)
    ax2.plot(
        t,
        [sum(s.get("duplex_engine_sessions", {}).values()) for s in samples],
        ls=":",
        label="engine slots",
    )
    ax2.set_ylabel("sessions")
    ax2.set_xlabel("minutes")
    ax2.legend(loc="upper right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ---------------------------------------------------------------------------- main
async def soak(
    addr: str, pid: int, args: argparse.Namespace, test_stage: bool, grace_s: float
) -> dict[str, Any]:
    realtime = (not test_stage) if args.client == "auto" else args.client == "realtime"
    driver = Driver(addr, test_stage, args.chaos, args.timeout, realtime)
    samples: list[dict[str, Any]] = []
    stop = asyncio.Event()
    t0 = time.monotonic()
    deadline = t0 + args.minutes * 60
    sampling = asyncio.create_task(sampler(addr, pid, t0, args.sample_s, stop, samples))
    rng = random.Random(args.seed)
    loops = [driver.loop(i, deadline, random.Random(rng.random())) for i in range(args.sessions)]
    await asyncio.gather(*loops)
    run_s = time.monotonic() - t0
    # the abandoned sessions' grace, the reaper and their clean-up: what is left after that
    # (polled, so that a quick end is not waited for) is left over
    settle_by = time.monotonic() + grace_s + 10.0
    await asyncio.sleep(grace_s)
    while True:
        last = await asyncio.to_thread(scrape, addr)
        left = last["health_sessions"] + sum(last.get("duplex_engine_sessions", {}).values())
        if left == 0 or time.monotonic() > settle_by:
            break
        await asyncio.sleep(0.5)
    await asyncio.sleep(1.5)  # the engine's figures are refreshed every reaper_interval_s
    last = await asyncio.to_thread(scrape, addr)
    stop.set()
    await sampling
    warmup_s = args.warmup_min * 60 if args.warmup_min is not None else min(300.0, run_s / 3)
    slope = slope_mb_per_h(samples, warmup_s)
    st = driver.stats
    result: dict[str, Any] = {
        "rss_slope_mb_per_h": round(slope, 2),
        "leftover_sessions": int(last["health_sessions"]),
        "leftover_slots": int(sum(last.get("duplex_engine_sessions", {}).values())),
        "failures": len(st.failures),
        "failure_details": st.failures[:20],
        # by kind: a timeout (no event for --timeout s), refused (the server shed the
        # session: error resource_exhausted, no slot), other (a wrong event, status or seq)
        "failure_kinds": dict(Counter(_kind(f["what"]) for f in st.failures)),
        "sessions_run": st.sessions,
        "turns": dict(st.turns),
        "client": "realtime" if realtime else "burst",
        "first_audio_s": _percentiles(st.first_audio_s),
        "ends": dict(st.ends),
        "chaos_affected_turns": st.chaos_affected,
        "silent_answers": st.silent_answers,
        "rss_mb_first": round(samples[0]["rss_mb"], 1),
        "rss_mb_after_warmup": round(
            next((s["rss_mb"] for s in samples if s["t_s"] >= warmup_s), float("nan")), 1
        ),
        "rss_mb_last": round(samples[-1]["rss_mb"], 1),
        "rss_children_mb_last": round(samples[-1]["rss_children_mb"], 1),
        "session_bytes_last": last.get("duplex_session_bytes", {}),
        "sessions_by_state_last": last.get("duplex_sessions", {}),
        "minutes": args.minutes,
        "sessions": args.sessions,
        "warmup_s": warmup_s,
        "grace_s": grace_s,
        "samples": [
            {k: s[k] for k in ("t_s", "rss_mb", "rss_children_mb", "health_sessions")}
            for s in samples
        ],
    }
    if args.plot:
        plot(
            samples,
            warmup_s,
            slope,
            Path(args.plot),
            f"{args.sessions} sessions, {Path(args.config).name}",
        )
        result["plot"] = str(args.plot)
    return result


def _kind(what: str) -> str:
    if what.startswith("timeout"):
        return "timeout"
    return "refused" if "resource_exhausted" in what else "other"


def _percentiles(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {}
    a = np.array(xs)
    return {
        "n": len(xs),
        "p50": round(float(np.percentile(a, 50)), 2),
        "p95": round(float(np.percentile(a, 95)), 2),
        "max": round(float(a.max()), 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--config", default=str(ROOT / "configs" / "cpu.yaml"))
    p.add_argument("--json", dest="json_path")
    p.add_argument("--plot", help="PNG of RSS and sessions over time")
    p.add_argument("--warmup-min", type=float, help="default: min(5, a third of the run)")
    p.add_argument("--grace", type=float, help="disconnect_grace_s (default: the config's)")
    p.add_argument("--sample-s", type=float, default=5.0)
    p.add_argument("--timeout", type=float, default=60.0, help="per event (s)")
    p.add_argument("--chaos", action="store_true", help="crash the LLM worker now and then")
    p.add_argument(
        "--client",
        choices=("auto", "realtime", "burst"),
        default="auto",
        help="realtime: speak at real time and hear each answer out before the next turn "
        "(a real voice client); burst: send speech at once, next turn at once; auto: "
        "realtime on real models, burst on the test stage (its TTS is paced by --pace)",
    )
    p.add_argument("--seed", type=int, default=17)
    p.add_argument("--pace", type=float, default=3.0, help="test stage: speech x real time")
    p.add_argument("--server-log", help="write the server's output here")
    args = p.parse_args()
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="duplex-soak-") as tmp:
        cfg, test_stage = soak_config(
            Path(args.config), Path(tmp), args.grace, args.chaos, args.pace
        )
        grace_s = float(
            yaml.safe_load(cfg.read_text())["engine"]
            .get("duplex", {})
            .get("disconnect_grace_s", 30.0)
        )
        log = open(args.server_log, "wb") if args.server_log else None
        try:
            with running_server(cfg, log=log) as (addr, pid):
                result = asyncio.run(soak(addr, pid, args, test_stage, grace_s))
        finally:
            if log is not None:
                log.close()
    result["loadavg_start"] = [round(x, 2) for x in load0]
    result["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    result["cpus"] = os.cpu_count()
    summary = {k: v for k, v in result.items() if k not in ("samples", "failure_details")}
    print(json.dumps(summary, indent=1))
    for f in result["failure_details"][:5]:
        print("failure:", f, file=sys.stderr)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
