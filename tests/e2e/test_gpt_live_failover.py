"""A GPT-Live session outlives its front end as a Realtime one does (docs/protocol.md §14,
docs/scale.md): an engine process, two front ends and a real HAProxy on 127.0.0.1. ``kill
-9`` of the front end holding a Live session: OpenAI's SDK client reconnects by itself
through HAProxy (its ``on_reconnecting`` gives the resume token and the route key), the other
front end takes the session over from the engine, and the conversation goes on, on the same
session, with no event id sent twice (also after a second takeover)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.cluster import HAPROXY, Cluster, cluster
from engine.duplex.fencing import route_key_of
from tests.e2e.live_sdk import LiveCall, live_call
from tests.server.harness import silence, tone, write_config

pytestmark = [
    pytest.mark.long,  # make test-long, a CI tier after make test
    pytest.mark.skipif(
        not Path(HAPROXY).exists(),
        reason="needs haproxy (Debian: apt-get install -y haproxy; `make test` installs it)",
    ),
]

HEARD = "tell me about the sea"
ENGINE = {
    "stages": {
        "asr": {"backend": "test", "options": {"transcript": HEARD}},
        "llm": {"backend": "test", "options": {"token_interval_s": 0.002, "echo_prompt": True}},
        "tts": {"backend": "test", "options": {"ms_per_word": 20}},
    },
    "duplex": {"disconnect_grace_s": 30},
}


@pytest.fixture
def two_fronts(tmp_path: Path) -> Iterator[Cluster]:
    with cluster(write_config(tmp_path, engine=ENGINE), fronts=2) as c:
        yield c


async def _speak(call: LiveCall) -> None:
    await call.stream(silence(200) + tone(800) + silence(700))


def test_kill_9_resumes_a_live_session_on_the_other_front_end(two_fronts: Cluster) -> None:
    c = two_fronts

    async def run() -> None:
        state: dict[str, str] = {}

        def on_reconnecting(event: Any) -> dict[str, Any]:
            # no X-Last-Event-Id: the taker cannot know what the dead front end wrote
            return {
                "extra_headers": {"X-Resume-Token": state["token"]},
                "extra_query": {"route": state["route"]},
            }

        for _ in range(8):  # HAProxy spreads new sessions: take one that lands on w1
            async with live_call(
                c.lb, {"model": "gpt-live-1"}, on_reconnecting=on_reconnecting, initial_delay=0.1
            ) as call:
                started = call.of("session.started")[0]
                sid = started.session.id
                if route_key_of(sid) != "w1":
                    await call.conn.session.close()
                    await call.until("session.closed")
                    continue
                state["token"] = started.resume_token
                state["route"] = "w1"
                await _speak(call)
                await call.until("session.input_transcript.delta", within=20)
                await call.until("session.output_transcript.delta", within=20)
                n = len(call.events)
                await asyncio.to_thread(c.kill, "w1")
                info = await call.until(
                    "info", within=20, after=n, pred=lambda e: e.code == "session.resumed"
                )
                assert info.resume_token.startswith(sid + ".")  # the same session
                assert info.resume_token != state["token"]
                m = len(call.events)
                await _speak(call)  # the conversation goes on, on the other front end
                heard = await call.until("session.input_transcript.delta", within=20, after=m)
                assert heard.delta == HEARD
                await call.until("session.output_transcript.delta", within=20, after=m)
                # again: w1 comes back, the session's new front end (w2) dies, w1 takes it
                await asyncio.to_thread(c.start_front, "w1")
                await asyncio.to_thread(c.wait_routed, "w1")
                state["token"] = info.resume_token
                m = len(call.events)
                await asyncio.to_thread(c.kill, "w2")
                again = await call.until(
                    "info", within=20, after=m, pred=lambda e: e.code == "session.resumed"
                )
                assert again.resume_token.startswith(sid + ".")
                m = len(call.events)
                await _speak(call)
                await call.until("session.output_transcript.delta", within=20, after=m)
                ids = [e.event_id for _, e in call.events if getattr(e, "event_id", None)]
                assert len(ids) == len(set(ids)), [
                    (e.type, e.event_id) for _, e in call.events if getattr(e, "event_id", None)
                ]  # no event was sent twice
                await call.conn.session.close()
                closed = await call.until("session.closed", within=10, after=m)
                assert closed.reason == "close_requested"
                return
        raise AssertionError("no Live session landed on w1")

    asyncio.run(run())
