"""A front end killed during a real answer on the CPU default (configs/cpu.yaml: Whisper,
SmolLM2 on llama.cpp, Piper) under `serve --workers 2` and HAProxy: the SDK session resumes
on the other front end (``session.resync_required{front_end_lost}``, same id) and the next
answer is built from the whole conversation, the turns before the crash included (its
prompt's token count shows it), while the supervisor starts the killed front end again.
The same for the engine process: the supervisor starts it again, it takes the session back
from its store, and the session goes on on its open socket."""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path

import pytest
from duplex_client import DuplexClient
from duplex_client import events as ev

from bench.cluster import child_pid
from engine.duplex.fencing import route_key_of
from tests.e2e.test_failover import _until
from tests.e2e.test_supervise import HAPROXY, workers
from tests.server.harness import ROOT

pytestmark = [
    pytest.mark.long,  # make test-long, a CI tier after make test
    pytest.mark.models,
    pytest.mark.skipif(
        not Path(HAPROXY).exists(), reason="needs haproxy (`make test` installs it)"
    ),
]


async def _done(client: DuplexClient, text: str) -> tuple[str, int]:
    """Ask ``text``; the answer's transcript and its input tokens (the prompt's length)."""
    await client.send_text(text)
    parts: list[str] = []
    while True:
        event = await client.next_event(180)
        if isinstance(event, ev.TranscriptDelta):
            parts.append(event.delta)
        if isinstance(event, ev.ResponseDone):
            assert event.response.status in ("completed", "incomplete"), event
            usage = event.response.usage
            assert usage is not None
            return "".join(parts), usage.input_tokens


def test_kill_9_during_a_real_answer_resumes_with_the_conversation(tmp_path: Path) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with workers(tmp_path, config=ROOT / "configs" / "cpu.yaml", ready_s=300) as w:

        async def run() -> None:
            client = await DuplexClient.connect(f"ws://{w.lb}/v1/realtime")
            try:
                sid = client.session_id
                await client.update_session({"turn_detection": None})
                first, tokens_first = await _done(client, "My name is Zorblax. Say hello to me.")
                await client.send_text("Tell me a short story about a cat.")
                await _until(client, ev.AudioDelta, 120)  # mid-answer: real Piper audio
                pid = w.pid(route_key_of(sid) or "")
                await asyncio.to_thread(subprocess.run, ["kill", "-9", str(pid)], check=True)
                while not isinstance(event := await client.next_event(60), ev.ResyncRequired):
                    pass
                assert event.reason == "front_end_lost"  # taken over by the other front end
                third, tokens_third = await _done(client, "What is my name?")
                assert third.strip()
                assert client.session_id == sid and client.resumes == 1
                # the prompt holds the first turn, its answer included (every word is at
                # least one token), and the new question: the history survived the crash.
                # (SmolLM2-135M does not reliably repeat the name back, so the prompt's
                # size is the check; a lost history would give instructions + question.)
                least = tokens_first + len(first.split()) + 4
                assert tokens_third >= least, (tokens_first, first, tokens_third)
                killed = route_key_of(sid) or ""
                await asyncio.to_thread(w.ready, killed, 120)  # the supervisor restarted it
                assert w.pid(killed) != pid
            finally:
                await client.close()

        asyncio.run(run())


def test_kill_9_of_the_engine_during_a_real_answer_keeps_the_session(tmp_path: Path) -> None:
    """The engine process killed during a spoken answer on the CPU default: the supervisor
    starts it again (the models load again) and it takes the session back from its store;
    the client's socket stays open, the answer that was running ends
    (``session.resync_required{engine_restarted}``, ``response.done{cancelled}``), the
    session keeps its id and the next answer is built from the whole conversation."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with workers(tmp_path, config=ROOT / "configs" / "cpu.yaml", ready_s=300) as w:

        async def run() -> None:
            client = await DuplexClient.connect(f"ws://{w.lb}/v1/realtime")
            try:
                sid = client.session_id
                await client.update_session({"turn_detection": None})
                first, tokens_first = await _done(client, "My name is Zorblax. Say hello to me.")
                await client.send_text("Tell me a short story about a cat.")
                await _until(client, ev.AudioDelta, 120)  # mid-answer: real Piper audio
                engine = child_pid(w.sup.pid, b"engine", b"--listen")
                assert engine is not None
                await asyncio.to_thread(subprocess.run, ["kill", "-9", str(engine)], check=True)
                while not isinstance(event := await client.next_event(300), ev.ResyncRequired):
                    pass
                assert event.reason == "engine_restarted"  # the engine took the session back
                while not isinstance(event := await client.next_event(60), ev.ResponseDone):
                    pass
                assert event.response.status == "cancelled"
                third, tokens_third = await _done(client, "What is my name?")
                assert third.strip()
                assert client.session_id == sid and client.resumes == 0  # never reconnected
                # the prompt holds the first turn and its answer (as in the test above)
                least = tokens_first + len(first.split()) + 4
                assert tokens_third >= least, (tokens_first, first, tokens_third)
                assert child_pid(w.sup.pid, b"engine", b"--listen") != engine
            finally:
                await client.close()

        asyncio.run(run())
