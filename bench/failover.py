"""Failover benchmark: a front end killed (kill -9) mid-answer and mid-input, then a rolling
restart (SIGTERM drain) of every front end, under N live sessions (docs/scale.md).

Topology (bench/cluster.py): one engine process, two front ends (w1, w2) started one by one,
HAProxy in front, the test stage (configs/test.yaml; a real-time TTS so answers last, an LLM
that echoes its whole prompt so an answer shows the conversation, an ASR that says how many
ms of audio it heard). Every session is a Python SDK client (clients/duplex_client, which
resumes by itself and re-sends the input the server lacks):

1. turn 1: a text turn ("alpha"), answered;
2. the crash: each session starts an answer ("bravo") and streams 2000 ms of audio in real
   time (20 ms frames); 1 s in, w1 is killed (kill -9); w1's sessions resume through HAProxy
   on w2 while the audio goes on; then each session commits its audio and asks for an answer:
   the transcript must say 2000 ms (more: input duplicated; less: input lost) and the answer
   must name "alpha" (the conversation survived);
3. w1 is started again; a rolling restart: w2 gets SIGTERM while its sessions are
   mid-answer (it drains: answers finish, sessions are handed over), is started again, then
   w1 the same; after it, each session has one more answered turn that names "alpha", and no
   session.resync_required may come in this phase.

JSON: ``sessions_lost`` (a session that failed or whose conversation did not survive),
``events_duplicated`` (events whose seq the client already had: the SDK drops them and counts
them), ``input_duplicated`` / ``input_lost`` (sessions whose transcript heard more / less than
was sent, beyond the resampler's few ms), ``resume_after_crash_ms_p99`` (kill -9 -> the
session resumed on the other front end: ``session.resumed`` there, per session of w1),
``drain_s`` (SIGTERM -> the front end exited, the longest of the two), ``resync_after_drain``
(must be 0).

    python -m bench.failover --sessions 50 [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from duplex_client import DuplexClient
from duplex_client import events as ev

from bench.cluster import Cluster, cluster
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
        self.resyncs = 0
        self.heard_ms: int | None = None

    async def event(self) -> ev.AnyServerEvent:
        e = await self.client.next_event(TIMEOUT_S)
        if isinstance(e, ev.ResyncRequired):
            self.resyncs += 1
        if isinstance(e, ev.InputTranscriptCompleted) and e.transcript.startswith("user audio"):
            self.heard_ms = int(e.transcript.split()[3])
        return e

    async def until(self, kind: type[ev.ServerEvent]) -> None:
        while not isinstance(await self.event(), kind):
            pass

    async def answer(self, text: str | None) -> str:
        """Send ``text`` (None: the audio buffer) and wait for a completed answer."""
        if text is not None:
            await self.client.send_text(text)
        else:
            await self.client.commit()
            await self.client.create_response()
        parts: dict[str, list[str]] = {}
        while True:
            e = await self.event()
            if isinstance(e, ev.TranscriptDelta):
                parts.setdefault(e.response_id, []).append(e.delta)
            elif isinstance(e, ev.ResponseDone) and e.response.status == "completed":
                return "".join(parts.get(e.response.id, []))

    async def settle(self) -> None:
        """Wait out any answer in flight (a completed or cancelled response.done), briefly."""
        try:
            while True:
                e = await asyncio.wait_for(self.event(), 3.0)
                if isinstance(e, ev.ResponseDone):
                    return
        except TimeoutError:
            return


async def run(c: Cluster, n: int) -> dict[str, Any]:
    sessions = [Session(await DuplexClient.connect(f"ws://{c.lb}/v1/realtime")) for _ in range(n)]
    lost: set[int] = set()
    loop = asyncio.get_running_loop()

    async def each(fn: Any) -> None:
        async def one(i: int, s: Session) -> None:
            if i in lost:
                return
            try:
                await fn(s)
            except Exception as exc:
                print(f"session {i} lost: {type(exc).__name__}: {exc}", file=sys.stderr)
                lost.add(i)

        await asyncio.gather(*(one(i, s) for i, s in enumerate(sessions)))

    async def first(s: Session) -> None:
        await s.client.update_session({"turn_detection": None})
        if "alpha" not in await s.answer("alpha"):
            raise Lost("turn 1")

    await each(first)
    # ---------------------------------------------------------------- the crash
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

    victims = {i for i, s in enumerate(sessions) if s.key == "w1"}
    await asyncio.gather(each(crash_turn), killer())

    async def after_crash(s: Session) -> None:
        await s.settle()  # a survivor's bravo answer (a victim's was lost with w1)
        await asyncio.sleep(1.5)  # the input lane has processed the audio
        if "alpha" not in await s.answer(None):
            raise Lost("the conversation did not survive the crash")

    await each(after_crash)
    resume_ms = [
        (at - killed_at) * 1000
        for i in victims
        if (at := sessions[i].client.resumed_at) is not None and i not in lost
    ]
    heard = [s.heard_ms for i, s in enumerate(sessions) if i not in lost]
    input_dup = sum(1 for h in heard if h is not None and h > AUDIO_MS + 5)
    input_lost = sum(1 for h in heard if h is None or h < AUDIO_MS - TAIL_MS)
    # ---------------------------------------------------------------- rolling restart
    await loop.run_in_executor(None, c.start_front, "w1")
    await loop.run_in_executor(None, c.wait_routed, "w1")
    before = [s.resyncs for s in sessions]
    drains: list[float] = []
    for key in ("w2", "w1"):

        async def mid_answer(s: Session, key: str = key) -> None:
            if route_key_of(s.client.session_id) == key:  # where it lives now (w2 after the crash)
                await s.client.send_text("delta")
                await s.until(ev.AudioDelta)

        await each(mid_answer)
        drains.append(await loop.run_in_executor(None, c.drain, key))
        await each(lambda s: s.settle())
        await loop.run_in_executor(None, c.start_front, key)
        await loop.run_in_executor(None, c.wait_routed, key)

    async def last(s: Session) -> None:
        if "alpha" not in await s.answer("echo"):
            raise Lost("the conversation did not survive the rolling restart")

    await each(last)
    resync_after_drain = sum(s.resyncs - b for s, b in zip(sessions, before, strict=True))
    duplicated = sum(s.client.duplicates_dropped for s in sessions)
    for s in sessions:
        await s.client.close()
    return {
        "sessions": n,
        "sessions_on_killed_front_end": len(victims),
        "sessions_lost": len(lost),
        "events_duplicated": duplicated,
        "input_duplicated": input_dup,
        "input_lost": input_lost,
        "resume_after_crash_ms_p50": round(float(np.percentile(resume_ms, 50)), 1)
        if resume_ms
        else None,
        "resume_after_crash_ms_p99": round(float(np.percentile(resume_ms, 99)), 1)
        if resume_ms
        else None,
        "drain_s": round(max(drains), 2),
        "resync_after_drain": resync_after_drain,
        "resumes": sum(s.client.resumes for s in sessions),
    }


ROWS = (
    (
        "sessions (on the killed front end)",
        lambda r: f"{r['sessions']} ({r['sessions_on_killed_front_end']})",
    ),
    ("sessions_lost", lambda r: r["sessions_lost"]),
    ("events_duplicated", lambda r: r["events_duplicated"]),
    ("input_duplicated / input_lost", lambda r: f"{r['input_duplicated']} / {r['input_lost']}"),
    (
        "resume after crash p50 / p99 ms",
        lambda r: f"{r['resume_after_crash_ms_p50']} / {r['resume_after_crash_ms_p99']}",
    ),
    ("drain_s (longest of the two)", lambda r: r["drain_s"]),
    ("resync_after_drain", lambda r: r["resync_after_drain"]),
    ("resumes", lambda r: r["resumes"]),
)


def table(result: dict[str, Any]) -> str:
    """The figures as a two-column table, with the load and the machine probe under it."""
    lines = [f"{'figure':<36} value"]
    lines += [f"{name:<36} {get(result)}" for name, get in ROWS]
    lines.append(
        f"load average at start {result['loadavg_start']}, end {result['loadavg_end']}; "
        f"{result['cpus']} CPUs; probe {result['probe_ms']} ms (bench/probe.py)"
    )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
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
    }
    with tempfile.TemporaryDirectory(prefix="duplex-failover-") as tmp:
        server = {"drain_s": args.drain_s, "drain_health_s": 2.5}
        config = write_config(Path(tmp), engine=engine, server=server)
        with cluster(config, fronts=2) as c:
            result = asyncio.run(run(c, args.sessions))
    result["loadavg_start"] = [round(x, 2) for x in load0]
    result["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    result["cpus"] = os.cpu_count()
    result["probe_ms"] = probe_ms()
    print(table(result))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
