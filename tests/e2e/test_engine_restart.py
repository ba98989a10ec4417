"""Sessions outlive the engine (docs/scale.md): ``serve --workers 2`` behind a real HAProxy on
127.0.0.1, SDK clients, the test stages; ``kill -9`` of the engine process. The supervisor
starts it again and it takes its sessions back from its store; meanwhile every client's
socket stays open, ``/health`` answers 200 ``engine_restarting``, a new session is refused
with ``engine_unavailable`` (close 1013, "try again") and a batch request with 503 and
``Retry-After``. Then a session that was mid-answer gets ``session.resync_required{reason:
"engine_restarted"}`` and its answer ends ``cancelled``; an idle one sees nothing at all;
each goes on with its id, its conversation and its item ids, and no event comes twice."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from duplex_client import DuplexClient, SessionRefused
from duplex_client import events as ev

from bench.cluster import child_pid, health
from engine.duplex.fencing import route_key_of
from tests.e2e.test_failover import ENGINE, _answer, _reply_to, _until
from tests.e2e.test_supervise import HAPROXY, Workers, wait_until, workers
from tests.server.harness import UNIT, write_config

pytestmark = [
    pytest.mark.long,  # make test-long, a CI tier after make test
    pytest.mark.skipif(
        not Path(HAPROXY).exists(), reason="needs haproxy (`make test` installs it)"
    ),
]

LONG = "bravo " + " ".join(["and"] * 40)  # an answer that runs for seconds


def _batch(addr: str) -> tuple[int, str | None, dict[str, object]]:
    body = json.dumps({"model": "duplex", "messages": [{"role": "user", "content": "hi"}]})
    req = urllib.request.Request(
        f"http://{addr}/v1/chat/completions",
        data=body.encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.headers.get("Retry-After"), {}
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("Retry-After"), json.loads(exc.read())


def _engine_pid(w: Workers) -> int:
    pid = child_pid(w.sup.pid, b"engine", b"--listen")
    assert pid is not None, "no engine process"
    return pid


async def _turn(client: DuplexClient, text: str) -> tuple[str, list[str]]:
    """A text turn; its completed answer and the ids of the items it added."""
    await client.send_text(text)
    ids: list[str] = []
    parts: list[str] = []
    while True:
        event = await client.next_event(30 * UNIT)
        if isinstance(event, ev.ItemDone):
            ids.append(event.item.id)
        if isinstance(event, ev.TranscriptDelta):
            parts.append(event.delta)
        if isinstance(event, ev.ResponseDone) and event.response.status == "completed":
            return "".join(parts), ids


def _restarting(w: Workers) -> bool:
    return all(health(addr)[1].get("status") == "engine_restarting" for addr in w.fronts.values())


def test_kill_9_of_the_engine_keeps_every_session(tmp_path: Path) -> None:
    config = write_config(
        tmp_path,
        engine={**ENGINE, "max_output_tokens": 512},  # the echoed conversation grows
        server={"drain_s": 10, "drain_health_s": 2.5},
    )
    with workers(tmp_path, config=config) as w:
        old = _engine_pid(w)

        async def run() -> None:
            clients = [await DuplexClient.connect(f"ws://{w.lb}/v1/realtime") for _ in range(4)]
            items: dict[str, list[str]] = {}
            try:
                for client in clients:
                    await client.update_session({"turn_detection": None})
                    answer, items[client.session_id] = await _turn(client, "alpha")
                    assert "alpha" in answer
                assert {route_key_of(c.session_id) for c in clients} == {"w1", "w2"}
                busy = [
                    next(c for c in clients if route_key_of(c.session_id) == key)
                    for key in ("w1", "w2")
                ]
                for client in busy:
                    await client.send_text(LONG)
                    await _until(client, ev.AudioDelta)
                os.kill(old, signal.SIGKILL)
                await asyncio.to_thread(wait_until, lambda: _restarting(w), 10, "restarting")
                # the outage: new sessions and batch requests are told to come back
                with pytest.raises(SessionRefused) as refused:
                    await DuplexClient.connect(f"ws://{w.lb}/v1/realtime")
                assert refused.value.code == "engine_unavailable", refused.value
                assert "restarting" in str(refused.value)
                status, retry_after, body = await asyncio.to_thread(_batch, w.fronts["w2"])
                assert (status, retry_after) == (503, "2"), (status, body)
                for client in busy:  # the running answer: said, and ended
                    event = await client.next_event(30 * UNIT)
                    while not isinstance(event, ev.ResyncRequired):
                        event = await client.next_event(30 * UNIT)
                    assert event.reason == "engine_restarted"
                    while not isinstance(event, ev.ResponseDone):
                        event = await client.next_event(30 * UNIT)
                    assert event.response.status == "cancelled"
                    assert event.response.status_details is not None
                    assert event.response.status_details.reason == "engine_restarted"
                for client in clients:  # the conversation, and every earlier item, go on
                    answer, _ = await _turn(client, "charlie")
                    assert "alpha" in answer and "charlie" in answer, answer
                    assert ("bravo" in answer) == (client in busy), answer
                    assert len(items[client.session_id]) == 2  # the user's and the answer's
                    for item_id in items[client.session_id]:
                        got = await _reply_to(
                            client, ev.ConversationItemRetrieve(item_id=item_id), ev.ItemRetrieved
                        )
                        assert got.item.id == item_id
                for client in clients:
                    assert client.resumes == 0 and client.duplicates_dropped == 0
            finally:
                for client in clients:
                    await client.close()

        asyncio.run(run())
        assert _engine_pid(w) != old and w.sup.poll() is None
        said = w.stderr.read_text()
        assert "the engine process exited (signal SIGKILL); restarting it in 0.25 s" in said
        assert "the engine process started again" in said


def test_an_idle_session_never_notices_an_engine_restart(tmp_path: Path) -> None:
    with workers(tmp_path, lb=False) as w:

        async def run() -> None:
            client = await DuplexClient.connect(f"ws://{w.fronts['w1']}/v1/realtime")
            try:
                await client.update_session({"turn_detection": None})
                assert "alpha" in await _answer(client, "alpha")
                engine_id = health(w.fronts["w1"])[1]["engine_id"]
                os.kill(_engine_pid(w), signal.SIGKILL)
                deadline = time.monotonic() + 60 * UNIT
                while True:  # back: the front end is attached to a new engine
                    state = health(w.fronts["w1"])[1]
                    if state.get("status") == "ok" and state.get("engine_id") != engine_id:
                        break
                    assert time.monotonic() < deadline, state
                    await asyncio.sleep(0.05)
                seen: list[ev.AnyServerEvent] = []
                try:  # nothing reaches the client but heartbeat acks
                    while True:
                        event = await client.next_event(1.0)
                        if not isinstance(event, ev.HeartbeatAck):
                            seen.append(event)
                except TimeoutError:
                    pass
                assert seen == []
                answer = await _answer(client, "bravo", clean=True)
                assert "alpha" in answer and "bravo" in answer, answer
            finally:
                await client.close()

        asyncio.run(run())
