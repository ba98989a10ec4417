"""Failover benchmark: what a client keeps when a front end is killed (``--kill front``), when
every front end is restarted one by one (``--kill drain``) and when the engine process is
killed (``--kill engine``), under N live sessions (docs/scale.md).

The test stage (configs/test.yaml; a real-time TTS so answers last, an LLM that echoes its
whole prompt so an answer shows the conversation, an ASR that says how many ms of audio it
heard). Every session is a Python SDK client (clients/duplex_client, which resumes by itself
and re-sends the input the server lacks). Each run: every session answers a text turn
("alpha"), then the phase, then every session answers one more turn that must name "alpha"
(the conversation survived) and checks its earlier items: each one retrieved by its old id,
the first answer truncated and the first user item deleted by theirs.

``--kill front`` (bench/cluster.py: an engine process, two front ends started one by one,
HAProxy): each session starts an answer ("bravo") and streams 2000 ms of audio in real time
(20 ms frames); 1 s in, w1 is killed (kill -9); w1's sessions resume through HAProxy on w2
while the audio goes on; then each session commits its audio and asks for an answer: the
transcript must say 2000 ms (more: input duplicated; less: input lost).

``--kill drain``: a rolling restart: w2 gets SIGTERM while its sessions are mid-answer (it
drains: answers finish, sessions are handed over), is started again, then w1 the same; no
``session.resync_required`` may come.

``--kill engine`` (``serve --workers 2`` behind HAProxy: its supervisor starts the engine
again, which takes its sessions back from its store): the sessions in four groups; a quarter
start an answer ("bravo"), a quarter stream 2000 ms of audio, a quarter ask for an answer as
the engine is killed, a quarter stay idle. 1 s into the audio the engine gets kill -9. The
answer that was running must end ``cancelled`` after ``session.resync_required{reason:
"engine_restarted"}``; the audio must be heard exactly once; the sessions that asked must be
answered; the idle ones must see nothing (no resync, no error, no cancelled answer).

JSON: ``sessions_lost`` (a session that failed or whose conversation did not survive),
``items_lost`` (earlier items not retrieved, truncated or deleted by their old id),
``events_duplicated`` (events whose seq the client already had: the SDK drops and counts
them), ``events_lost`` (gaps in a session's event numbering, besides the
``session.resumed`` the SDK does not show), ``input_duplicated`` / ``input_lost`` (sessions
whose transcript heard more / less than was sent, beyond the resampler's few ms); front:
``resume_after_crash_ms_p50`` / ``_p99`` (kill -9 -> ``session.resumed`` on the other front
end); drain: ``drain_s`` (SIGTERM -> exit, the longer of the two), ``resync_after_drain``
(must be 0); engine: ``engine_restart_back_ms_p50`` / ``_p99`` (kill -9 -> the
``response.created`` of an answer asked for at once: the one asked as it was killed, or the
next after the running one was cancelled), ``engine_start_ms`` (kill -9 -> a front end
attached to the new engine, its ``/health``), ``idle_noticed`` (idle sessions that saw any
of it; must be 0).

    python -m bench.failover --kill front|drain|engine --sessions 50 [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
from duplex_client import DuplexClient
from duplex_client import events as ev

from bench.cluster import Cluster, Supervised, cluster, health, supervised
from bench.probe import probe_ms
from engine.duplex.fencing import route_key_of
from tests.server.harness import write_config

AUDIO_MS = 2000
TAIL_MS = 25  # the resampler holds a few ms when the commit comes
TIMEOUT_S = 60.0


class Lost(Exception):
    pass


def tone(ms: int, rate: int = 24000) -> bytes:
    t = np.arange(int(rate * ms / 1000)) / rate
    return (np.sin(2 * np.pi * 300 * t) * 0.3 * 32767).astype("<i2").tobytes()


class Session:
    def __init__(self, client: DuplexClient) -> None:
        self.client = client
        self.key = route_key_of(client.session_id) or ""
        self.resyncs: list[str] = []
        self.heard_ms: int | None = None
        self.seqs: list[int] = []
        self.items: dict[str, str] = {}  # item id -> role, of the items seen
        self.events: list[ev.AnyServerEvent] = []  # since the last mark()
        self.asked_at = 0.0  # the answer asked for after a kill: time.monotonic()
        self.created_at: float | None = None  # ... and its response.created

    async def event(self) -> ev.AnyServerEvent:
        e = await self.client.next_event(TIMEOUT_S)
        self.events.append(e)
        if e.server_event_seq:
            self.seqs.append(e.server_event_seq)
        if isinstance(e, ev.ResyncRequired):
            self.resyncs.append(e.reason)
        if isinstance(e, ev.InputTranscriptCompleted) and e.transcript.startswith("user audio"):
            self.heard_ms = int(e.transcript.split()[3])
        if isinstance(e, ev.ItemAdded | ev.ItemDone) and isinstance(e.item, ev.Item):
            self.items[e.item.id] = e.item.role
        if isinstance(e, ev.ResponseCreated) and self.asked_at and self.created_at is None:
            self.created_at = time.monotonic()
        return e

    async def until(self, kind: type[ev.ServerEvent]) -> ev.AnyServerEvent:
        async with asyncio.timeout(TIMEOUT_S):  # heartbeat acks keep coming meanwhile
            while not isinstance(e := await self.event(), kind):
                pass
            return e

    async def answer(self, text: str | None) -> str:
        """Send ``text`` (None: the audio buffer) and wait for a completed answer."""
        if text is not None:
            await self.client.send_text(text)
        else:
            await self.client.commit()
            await self.client.create_response()
        parts: dict[str, list[str]] = {}
        async with asyncio.timeout(TIMEOUT_S):
            while True:
                e = await self.event()
                if isinstance(e, ev.TranscriptDelta):
                    parts.setdefault(e.response_id, []).append(e.delta)
                elif isinstance(e, ev.ResponseDone) and e.response.status == "completed":
                    return "".join(parts.get(e.response.id, []))

    async def settle(self, quiet_s: float = 3.0) -> None:
        """Wait out any answer in flight (a completed or cancelled response.done), briefly."""
        try:
            while True:
                e = await asyncio.wait_for(self.event(), quiet_s)
                if isinstance(e, ev.ResponseDone):
                    return
        except TimeoutError:
            return

    async def reply_to(self, event: ev.ClientEvent, kind: type[ev.ServerEvent]) -> bool:
        """Send ``event`` (with an event_id); True if ``kind`` answers it, False if an error."""
        eid = f"chk_{len(self.seqs)}_{time.monotonic_ns()}"
        await self.client.send_event(msgspec_replace(event, eid))
        async with asyncio.timeout(TIMEOUT_S):
            while True:
                e = await self.event()
                if isinstance(e, kind):
                    return True
                if isinstance(e, ev.Error) and e.error.event_id == eid:
                    print(f"{type(event).__name__}: {e.error.code}", file=sys.stderr)
                    return False

    async def items_lost(self, earlier: dict[str, str]) -> int:
        """Each earlier item retrieved by its id, the first answer truncated and the first
        user item deleted by theirs; how many of these failed."""
        lost = 0
        for item_id in earlier:
            ok = await self.reply_to(ev.ConversationItemRetrieve(item_id=item_id), ev.ItemRetrieved)
            lost += not ok
        answers = [i for i, role in earlier.items() if role == "assistant"]
        users = [i for i, role in earlier.items() if role == "user"]
        if answers:
            cut = ev.ConversationItemTruncate(item_id=answers[0], audio_end_ms=10)
            lost += not await self.reply_to(cut, ev.ItemTruncated)
        if users:
            gone = ev.ConversationItemDelete(item_id=users[0])
            lost += not await self.reply_to(gone, ev.ItemDeleted)
        return lost

    def events_lost(self) -> int:
        """Seqs missing from what the client got, besides each resume's session.resumed."""
        got = sorted(set(self.seqs))
        if not got:
            return 0
        return max(0, got[-1] - got[0] + 1 - len(got) - self.client.resumes)


def msgspec_replace(event: ev.ClientEvent, event_id: str) -> ev.ClientEvent:
    import msgspec

    return msgspec.structs.replace(event, event_id=event_id)


class Run:
    """The sessions of one run and what every phase shares."""

    def __init__(self, sessions: list[Session]) -> None:
        self.sessions = sessions
        self.lost: set[int] = set()
        self.earlier: list[dict[str, str]] = []

    async def each(
        self, fn: Callable[[Session], Awaitable[None]], only: set[int] | None = None
    ) -> None:
        async def one(i: int, s: Session) -> None:
            if i in self.lost or (only is not None and i not in only):
                return
            try:
                await fn(s)
            except Exception as exc:
                print(f"session {i} lost: {type(exc).__name__}: {exc}", file=sys.stderr)
                self.lost.add(i)

        await asyncio.gather(*(one(i, s) for i, s in enumerate(self.sessions)))

    async def first_turn(self) -> None:
        async def first(s: Session) -> None:
            await s.client.update_session({"turn_detection": None})
            if "alpha" not in await s.answer("alpha"):
                raise Lost("turn 1")

        await self.each(first)
        self.earlier = [dict(s.items) for s in self.sessions]
        say(f"{len(self.sessions)} sessions answered their first turn")

    async def last_turn(self, text: str) -> int:
        """One more answer naming alpha, then the items check; returns items lost."""
        items_lost = 0

        async def last(s: Session) -> None:
            nonlocal items_lost
            if "alpha" not in await s.answer(text):
                raise Lost("the conversation did not survive")
            items_lost += await s.items_lost(self.earlier[self.sessions.index(s)])

        await self.each(last)
        say(f"last turn answered; {items_lost} earlier item(s) lost")
        return items_lost

    def input_counts(self, group: set[int] | None = None) -> tuple[int, int]:
        heard = [
            s.heard_ms
            for i, s in enumerate(self.sessions)
            if i not in self.lost and (group is None or i in group)
        ]
        dup = sum(1 for h in heard if h is not None and h > AUDIO_MS + 5)
        lost = sum(1 for h in heard if h is None or h < AUDIO_MS - TAIL_MS)
        return dup, lost

    def common(self) -> dict[str, Any]:
        return {
            "sessions": len(self.sessions),
            "sessions_lost": len(self.lost),
            "events_duplicated": sum(s.client.duplicates_dropped for s in self.sessions),
            "events_lost": sum(s.events_lost() for s in self.sessions),
            "resumes": sum(s.client.resumes for s in self.sessions),
        }

    async def close(self) -> None:
        for s in self.sessions:
            await s.client.close()


def say(line: str) -> None:
    print(f"failover: {line}", file=sys.stderr, flush=True)


def _pct(xs: list[float], q: float) -> float | None:
    return round(float(np.percentile(xs, q)), 1) if xs else None


async def _open(lb: str, n: int) -> Run:
    return Run([Session(await DuplexClient.connect(f"ws://{lb}/v1/realtime")) for _ in range(n)])


# ------------------------------------------------------------------------------ phases
async def kill_front(c: Cluster, n: int) -> dict[str, Any]:
    r = await _open(c.lb, n)
    loop = asyncio.get_running_loop()
    await r.first_turn()
    killed_at = 0.0

    async def crash_turn(s: Session) -> None:
        await s.client.send_text("bravo")
        await s.until(ev.AudioDelta)
        await s.client.send_audio(tone(AUDIO_MS), realtime=True, chunk_ms=20)

    async def killer() -> None:
        nonlocal killed_at
        await asyncio.sleep(1.0 + 0.5)  # the answers started, the audio 1 s in
        killed_at = time.monotonic()
        await loop.run_in_executor(None, c.kill, "w1")

    victims = {i for i, s in enumerate(r.sessions) if s.key == "w1"}
    await asyncio.gather(r.each(crash_turn), killer())

    async def after_crash(s: Session) -> None:
        await s.settle()  # a survivor's bravo answer (a victim's was lost with w1)
        await asyncio.sleep(1.5)  # the input lane has processed the audio
        if "alpha" not in await s.answer(None):
            raise Lost("the conversation did not survive the crash")

    await r.each(after_crash)
    resume_ms = [
        (at - killed_at) * 1000
        for i in victims
        if (at := r.sessions[i].client.resumed_at) is not None and i not in r.lost
    ]
    dup, lost = r.input_counts()
    items_lost = await r.last_turn("echo")
    await r.close()
    return {
        **r.common(),
        "sessions_on_killed_front_end": len(victims),
        "items_lost": items_lost,
        "input_duplicated": dup,
        "input_lost": lost,
        "resume_after_crash_ms_p50": _pct(resume_ms, 50),
        "resume_after_crash_ms_p99": _pct(resume_ms, 99),
    }


async def drain(c: Cluster, n: int) -> dict[str, Any]:
    r = await _open(c.lb, n)
    loop = asyncio.get_running_loop()
    await r.first_turn()
    drains: list[float] = []
    for key in ("w2", "w1"):

        async def mid_answer(s: Session, key: str = key) -> None:
            if route_key_of(s.client.session_id) == key:  # where it lives now
                await s.client.send_text("delta")
                await s.until(ev.AudioDelta)

        await r.each(mid_answer)
        drains.append(await loop.run_in_executor(None, c.drain, key))
        await r.each(lambda s: s.settle())
        await loop.run_in_executor(None, c.start_front, key)
        await loop.run_in_executor(None, c.wait_routed, key)
    items_lost = await r.last_turn("echo")
    await r.close()
    return {
        **r.common(),
        "items_lost": items_lost,
        "input_duplicated": 0,
        "input_lost": 0,
        "drain_s": round(max(drains), 2),
        "resync_after_drain": sum(len(s.resyncs) for s in r.sessions),
        "resync_after_drain_reasons": sorted({why for s in r.sessions for why in s.resyncs}),
    }


async def kill_engine(w: Supervised, n: int) -> dict[str, Any]:
    r = await _open(w.lb, n)
    loop = asyncio.get_running_loop()
    await r.first_turn()
    answering = {i for i in range(n) if i % 4 == 0}
    streaming = {i for i in range(n) if i % 4 == 1}
    asking = {i for i in range(n) if i % 4 == 2}
    idle = {i for i in range(n) if i % 4 == 3}
    engine_id = health(w.fronts["w1"])[1].get("engine_id")
    killed = asyncio.Event()
    killed_at = 0.0
    back_at = 0.0

    async def before(s: Session) -> None:
        i = r.sessions.index(s)
        s.events.clear()
        if i in answering:  # an answer of some 60 words: it runs for seconds
            await s.client.send_text("bravo " + " ".join(["and"] * 60))
            await s.until(ev.AudioDelta)
        elif i in streaming:
            await s.client.send_audio(tone(AUDIO_MS), realtime=True, chunk_ms=20)
        elif i in asking:
            await killed.wait()
            s.asked_at = time.monotonic()
            if "alpha" not in await s.answer("charlie"):
                raise Lost("the answer asked for during the restart")

    async def killer() -> None:
        nonlocal killed_at, back_at
        await asyncio.sleep(1.0 + 0.5)  # the answers started, the audio 1 s in
        killed_at = time.monotonic()
        await loop.run_in_executor(None, w.kill_engine)
        killed.set()

        def attached() -> float:
            deadline = time.monotonic() + TIMEOUT_S
            while time.monotonic() < deadline:
                code, body = health(w.fronts["w1"])
                new = body.get("engine_id") not in (None, engine_id)
                if code == 200 and body.get("status") == "ok" and new:
                    return time.monotonic()
                time.sleep(0.02)
            raise RuntimeError("w1 did not attach to a new engine")

        back_at = await loop.run_in_executor(None, attached)
        say(f"engine killed; w1 attached to the new one {back_at - killed_at:.2f} s later")

    await asyncio.gather(r.each(before), killer())

    async def after(s: Session) -> None:
        i = r.sessions.index(s)
        if i in answering:  # the running answer is gone: said, then asked again
            while not isinstance(e := await s.event(), ev.ResponseDone):
                pass
            if e.response.status != "cancelled" or "engine_restarted" not in s.resyncs:
                raise Lost(f"the running answer ended {e.response.status}, resyncs {s.resyncs}")
            s.asked_at = time.monotonic()
            if "alpha" not in await s.answer("charlie"):
                raise Lost("the conversation did not survive the engine restart")
        elif i in streaming:
            await asyncio.sleep(1.5)  # the input lane has processed the audio
            if "alpha" not in await s.answer(None):
                raise Lost("the conversation did not survive the engine restart")

    await r.each(after)
    say("every group done after the restart")
    noticed = 0
    for i in idle:  # nothing at all reached them
        s = r.sessions[i]
        if s.events or s.resyncs:
            noticed += 1
            print(f"idle session {i} noticed: {s.events[:3]}", file=sys.stderr)
    back_ms = [
        (s.created_at - killed_at) * 1000
        for i, s in enumerate(r.sessions)
        if i in answering | asking and i not in r.lost and s.created_at is not None
    ]
    dup, lost = r.input_counts(streaming)
    items_lost = await r.last_turn("echo")
    unexpected = sum(
        1
        for i, s in enumerate(r.sessions)
        if i not in answering and "engine_restarted" in s.resyncs
    )
    await r.close()
    return {
        **r.common(),
        "items_lost": items_lost,
        "input_duplicated": dup,
        "input_lost": lost,
        "engine_restart_back_ms_p50": _pct(back_ms, 50),
        "engine_restart_back_ms_p99": _pct(back_ms, 99),
        "engine_start_ms": round((back_at - killed_at) * 1000, 1),
        "idle_noticed": noticed,
        "resync_not_mid_answer": unexpected,
    }


# ------------------------------------------------------------------------------ report
COMMON_ROWS: tuple[tuple[str, Callable[[dict[str, Any]], object]], ...] = (
    ("sessions", lambda r: r["sessions"]),
    ("sessions_lost", lambda r: r["sessions_lost"]),
    ("items_lost", lambda r: r["items_lost"]),
    ("events_duplicated / events_lost", lambda r: f"{r['events_duplicated']} / {r['events_lost']}"),
    ("input_duplicated / input_lost", lambda r: f"{r['input_duplicated']} / {r['input_lost']}"),
)
ROWS: dict[str, tuple[tuple[str, Callable[[dict[str, Any]], object]], ...]] = {
    "front": (
        ("on the killed front end", lambda r: r["sessions_on_killed_front_end"]),
        (
            "resume after crash p50 / p99 ms",
            lambda r: f"{r['resume_after_crash_ms_p50']} / {r['resume_after_crash_ms_p99']}",
        ),
        ("resumes", lambda r: r["resumes"]),
    ),
    "drain": (
        ("drain_s (longest of the two)", lambda r: r["drain_s"]),
        ("resync_after_drain", lambda r: r["resync_after_drain"]),
        ("resumes", lambda r: r["resumes"]),
    ),
    "engine": (
        (
            "back after the kill p50 / p99 ms",
            lambda r: f"{r['engine_restart_back_ms_p50']} / {r['engine_restart_back_ms_p99']}",
        ),
        ("engine_start_ms", lambda r: r["engine_start_ms"]),
        ("idle_noticed", lambda r: r["idle_noticed"]),
        ("resumes", lambda r: r["resumes"]),
    ),
}


def table(result: dict[str, Any]) -> str:
    """The figures as a two-column table, with the load and the machine probe under it."""
    lines = [f"{'figure (--kill ' + result['kill'] + ')':<36} value"]
    lines += [f"{name:<36} {get(result)}" for name, get in COMMON_ROWS + ROWS[result["kill"]]]
    lines.append(
        f"load average at start {result['loadavg_start']}, end {result['loadavg_end']}; "
        f"{result['cpus']} CPUs; probe {result['probe_ms']} ms (bench/probe.py)"
    )
    return "\n".join(lines)


def main() -> None:
    # SIGTERM (timeout, a CI runner) stops the servers this run started, like Ctrl-C does
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kill", choices=("front", "drain", "engine"), default="front")
    p.add_argument("--sessions", type=int, default=50)
    p.add_argument("--json", dest="json_path")
    p.add_argument("--drain-s", type=float, default=10.0, help="server.drain_s")
    args = p.parse_args()
    load0 = os.getloadavg()
    engine = {
        "stages": {
            "asr": {"options": {"transcript": None}},
            "llm": {"options": {"echo_prompt": True}},
            # speech at 3x real time: answers last seconds, not tens of seconds
            "tts": {"backend": "test", "options": {"realtime": True, "pace": 3.0}},
        },
        "duplex": {"disconnect_grace_s": 30, "max_sessions": max(1000, args.sessions * 2)},
        "max_output_tokens": 1024,  # the echoed conversation grows with every turn
    }
    with tempfile.TemporaryDirectory(prefix="duplex-failover-") as tmp:
        server = {"drain_s": args.drain_s, "drain_health_s": 2.5}
        config = write_config(Path(tmp), engine=engine, server=server)
        if args.kill == "engine":
            with supervised(config, fronts=2) as w:
                result = asyncio.run(kill_engine(w, args.sessions))
        else:
            with cluster(config, fronts=2) as c:
                phase = kill_front if args.kill == "front" else drain
                result = asyncio.run(phase(c, args.sessions))
    result["kill"] = args.kill
    result["loadavg_start"] = [round(x, 2) for x in load0]
    result["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    result["cpus"] = os.cpu_count()
    result["probe_ms"] = probe_ms()
    print(table(result))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
