"""Sessions outlive their front end (docs/scale.md): an engine process, two front ends
started one by one (route keys w1, w2) and a real HAProxy on 127.0.0.1. ``kill -9`` of a
front end mid-answer: its sessions resume through HAProxy on the other one with the same
session id, a new token, the conversation intact (the test LLM echoes its whole prompt) and
no event delivered twice; what the dead process may have lost is announced as
``session.resync_required{front_end_lost}``. SIGTERM drains a front end: the answer in
flight finishes, then its sessions are handed over and resume elsewhere with nothing lost."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from duplex_client import DuplexClient
from duplex_client import events as ev

from bench.cluster import HAPROXY, Cluster, cluster, health
from engine.duplex.fencing import route_key_of
from tests.server.harness import UNIT, Client, text_item, write_config

pytestmark = [
    pytest.mark.long,  # make test-long, a CI tier after make test
    pytest.mark.skipif(
        not Path(HAPROXY).exists(),
        reason="needs haproxy (Debian: apt-get install -y haproxy; `make test` installs it)",
    ),
]

ENGINE = {
    "stages": {
        "llm": {"options": {"echo_prompt": True}},  # the answer shows the conversation
        "tts": {"backend": "test", "options": {"realtime": True}},
    },
    "duplex": {"disconnect_grace_s": 30},
}


@pytest.fixture
def two_fronts(tmp_path: Path) -> Iterator[Cluster]:
    config = write_config(tmp_path, engine=ENGINE, server={"drain_s": 10, "drain_health_s": 2.5})
    with cluster(config, fronts=2) as c:
        yield c


async def _answer(
    client: DuplexClient, text: str | None, wait_s: float = 20.0, *, clean: bool = False
) -> str:
    """Send ``text`` (and ask for an answer); the answer's transcript once it is done.
    ``clean``: no ``session.resync_required`` may come first."""
    if text is not None:
        await client.send_text(text)
    parts: dict[str, list[str]] = {}
    while True:
        event = await client.next_event(wait_s * UNIT)
        assert not (clean and isinstance(event, ev.ResyncRequired)), event
        if isinstance(event, ev.TranscriptDelta):
            parts.setdefault(event.response_id, []).append(event.delta)
        if isinstance(event, ev.ResponseDone) and event.response.status == "completed":
            return "".join(parts.get(event.response.id, []))


async def _until(client: DuplexClient, kind: type[ev.ServerEvent], wait_s: float = 20.0) -> None:
    while not isinstance(await client.next_event(wait_s * UNIT), kind):
        pass


async def _open(c: Cluster, n: int) -> list[DuplexClient]:
    clients = [await DuplexClient.connect(f"ws://{c.lb}/v1/realtime") for _ in range(n)]
    for client in clients:
        await client.update_session({"turn_detection": None})
        assert "alpha" in await _answer(client, "alpha")
    keys = {route_key_of(client.session_id) for client in clients}
    assert keys == {"w1", "w2"}, keys  # HAProxy spread them (least connections)
    return clients


async def _raw_on(c: Cluster, key: str) -> tuple[Client, dict[str, Any], Any]:
    """A raw WebSocket client (no SDK) whose session lives on front end ``key``."""
    for _ in range(6):
        cm = Client.connect(c.lb)
        raw: Client = await cm.__aenter__()
        created = await raw.until("session.created")
        if route_key_of(created["session"]["id"]) == key:
            return raw, created, cm
        await raw.send({"type": "session.close"})
        await cm.__aexit__(None, None, None)
    raise AssertionError(f"no session landed on {key}")


def test_kill_9_mid_answer_resumes_on_the_other_front_end(two_fronts: Cluster) -> None:
    c = two_fronts

    async def run() -> None:
        clients = await _open(c, 4)
        raw, created, raw_cm = await _raw_on(c, "w1")
        try:
            await raw.send({"type": "session.update", "session": {"turn_detection": None}})
            await raw.send(text_item("alpha"))
            await raw.send({"type": "response.create"})
            await raw.until("response.done", within=20)
            await raw.send(text_item("bravo"))
            await raw.send({"type": "response.create"})
            await raw.until("response.output_audio.delta", within=20)
            ids = [client.session_id for client in clients]
            tokens = [client.resume_token for client in clients]
            for client in clients:  # every session mid-answer
                await client.send_text("bravo")
                await _until(client, ev.AudioDelta)
            victims = [cl for cl in clients if route_key_of(cl.session_id) == "w1"]
            await asyncio.to_thread(c.kill, "w1")
            start = time.monotonic()
            for client in victims:  # the SDK resumes through HAProxy by itself
                await _until(client, ev.ResyncRequired)
            took = time.monotonic() - start
            # the raw client: its socket dropped; it resumes through HAProxy by hand
            with contextlib.suppress(Exception):
                await raw.drain(1.0)
            await raw_cm.__aexit__(None, None, None)
            last = raw.events[-1]["server_event_seq"]
            async with Client.connect(c.lb, "?" + created["resume_query"]) as again:
                await again.send(
                    {
                        "type": "session.resume",
                        "session_id": created["session"]["id"],
                        "resume_token": created["resume_token"],
                        "last_received_server_event_seq": last,
                    }
                )
                resync = await again.until("session.resync_required", within=10)
                assert resync["reason"] == "front_end_lost" and resync["last_seq"] >= last
                resumed = await again.until("session.resumed")
                assert resumed["session_id"] == created["session"]["id"]
                assert resumed["resume_token"] != created["resume_token"]
                await again.send(text_item("charlie"))
                await again.send({"type": "response.create"})
                done = await again.until("response.done", within=30)
                while done["response"]["status"] != "completed":  # bravo's may end first
                    done = await again.until("response.done", within=30)
                seqs = [e["server_event_seq"] for e in raw.events + again.events]
                assert seqs == sorted(set(seqs)), seqs  # never a seq twice, always forward
                text = done["response"]["output"][0]["content"][0]["transcript"]
                assert "alpha" in text and "charlie" in text, text
                await again.send({"type": "session.close"})
            for client in clients:
                if client not in victims:
                    assert "bravo" in await _answer(client, None)  # its answer went on
                answer = await _answer(client, "charlie")
                # the conversation is intact: the first turn is in the prompt
                assert "alpha" in answer and "charlie" in answer, answer
            for client, sid, token in zip(clients, ids, tokens, strict=True):
                moved = client in victims
                assert client.session_id == sid
                assert client.resumes == (1 if moved else 0)
                assert (client.resume_token != token) == moved
                assert client.duplicates_dropped == 0  # no seq was sent twice
            assert took < 10 * UNIT, took
        finally:
            for client in clients:
                await client.close()

    asyncio.run(run())


def test_sigterm_drains_and_hands_sessions_over(two_fronts: Cluster) -> None:
    c = two_fronts

    async def run() -> None:
        clients = await _open(c, 4)
        try:
            movers = [cl for cl in clients if route_key_of(cl.session_id) == "w2"]
            for client in movers:
                await client.send_text("bravo")
                await _until(client, ev.AudioDelta)
            drain = asyncio.create_task(asyncio.to_thread(c.drain, "w2"))
            await asyncio.sleep(0.5)
            assert health(c.fronts["w2"])[0] == 503  # draining: HAProxy takes it out
            for client in movers:  # the answer in flight finishes, then the handover
                seen = []
                while not isinstance(
                    event := await client.next_event(30 * UNIT), ev.SessionHandover
                ):
                    seen.append(event)
                assert any(
                    isinstance(e, ev.ResponseDone) and e.response.status == "completed"
                    for e in seen
                )
            assert await drain < 30
            for client in clients:  # nothing was lost: no session.resync_required
                answer = await _answer(client, "charlie", clean=True)
                assert "alpha" in answer and "charlie" in answer, answer
            for client in movers:
                assert client.resumes == 1
                assert client.duplicates_dropped == 0
        finally:
            for client in clients:
                await client.close()

    asyncio.run(run())


async def _reply_to(client: DuplexClient, event: ev.ClientEvent, kind: type[ev.ServerEvent]) -> Any:
    """Send ``event``; its reply (``kind``), or an assertion naming the error."""
    eid = f"check_{id(event)}"
    await client.send_event(msgspec.structs.replace(event, event_id=eid))
    while True:
        got = await client.next_event(20 * UNIT)
        if isinstance(got, kind):
            return got
        assert not (isinstance(got, ev.Error) and got.error.event_id == eid), got


def test_every_earlier_item_works_by_its_id_after_a_front_end_is_killed(
    two_fronts: Cluster,
) -> None:
    """Items live with the conversation in the engine: the front end that takes a session
    over serves each earlier item id (retrieve, truncate, delete) and numbers new ones
    after them."""
    c = two_fronts

    async def run() -> None:
        clients = await _open(c, 4)
        items: dict[str, dict[str, ev.AnyItem]] = {cl.session_id: {} for cl in clients}
        try:
            for client in clients:  # a second turn; every item of both is remembered
                await client.send_text("bravo")
                while True:
                    event = await client.next_event(20 * UNIT)
                    if isinstance(event, ev.ItemDone):
                        items[client.session_id][event.item.id] = event.item
                    if isinstance(event, ev.ResponseDone):
                        break
            victims = [cl for cl in clients if route_key_of(cl.session_id) == "w1"]
            await asyncio.to_thread(c.kill, "w1")
            for client in victims:
                await _until(client, ev.ResyncRequired)
                earlier = items[client.session_id]
                assert len(earlier) == 2  # the user's and the answer's
                for item_id, item in earlier.items():
                    got = await _reply_to(
                        client, ev.ConversationItemRetrieve(item_id=item_id), ev.ItemRetrieved
                    )
                    assert got.item == item
                answer = next(i for i, it in earlier.items() if it.role == "assistant")
                user = next(i for i, it in earlier.items() if it.role == "user")
                cut = ev.ConversationItemTruncate(item_id=answer, audio_end_ms=100)
                truncated = await _reply_to(client, cut, ev.ItemTruncated)
                assert truncated.item_id == answer and truncated.audio_end_ms == 100
                gone = await _reply_to(
                    client, ev.ConversationItemDelete(item_id=user), ev.ItemDeleted
                )
                assert gone.item_id == user
                # the deleted item is out of the prompt, the truncated answer is cut there,
                # and the next items are numbered after the old ones
                await client.send_text("charlie")
                while True:
                    event = await client.next_event(20 * UNIT)
                    if isinstance(event, ev.ItemAdded):
                        assert event.item.id not in earlier
                    if isinstance(event, ev.ResponseDone) and event.response.status == "completed":
                        text = event.response.output[0].content[0].transcript or ""
                        # neither the deleted item nor the answer cut before it is left
                        assert "bravo" not in text, text
                        assert "alpha" in text and "charlie" in text, text
                        break
        finally:
            for client in clients:
                await client.close()

    asyncio.run(run())
