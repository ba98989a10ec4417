"""Twilio ``dtmf`` messages against the real server, from a Twilio-shaped WebSocket peer
(tests/server/twilio_sim.py): the digits reach the session in order as
``input_audio_buffer.dtmf_event_received`` and, with ``audio.input.dtmf_as_text``, as user
text items the model answers; the SDK decodes them as typed events."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from duplex_client import decode_event

from duplex_server.protocol import events as ev
from duplex_server.protocol.dtmf import dtmf_text
from tests.server.harness import UNIT, running_server, write_config
from tests.server.test_twilio import SHORT_TTS
from tests.server.twilio_sim import TwilioSim

#: the test LLM echoes the user's last words: an answer says which digit it read
ECHO_LLM = {**SHORT_TTS, "stages": {**SHORT_TTS["stages"], "llm": {"options": {"echo": True}}}}
DIGITS = ["1", "2", "#", "*", "9"]


def _frames(app: Any) -> list[bytes]:
    (session,) = list(app.state.hub.sessions.live.values())
    return session.journal.replay_after(0, time.monotonic()) or []


def _events(app: Any) -> list[dict[str, Any]]:
    return [json.loads(f) for f in _frames(app)]


async def _until(app: Any, cond: Any, within: float = 10) -> list[dict[str, Any]]:
    deadline = time.monotonic() + within * UNIT
    while True:
        events = _events(app)
        if cond(events):
            return events
        if time.monotonic() > deadline:
            raise TimeoutError(f"not met; got {[e['type'] for e in events]}")
        await asyncio.sleep(0.05)


def _dtmf(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["type"] == "input_audio_buffer.dtmf_event_received"]


def test_dtmf_digits_arrive_in_order_as_events_and_user_items(tmp_path: Path) -> None:
    apps: list[Any] = []
    path = write_config(tmp_path, engine=ECHO_LLM)

    async def run() -> None:
        session = {"audio": {"input": {"dtmf_as_text": True}}}
        async with TwilioSim.call(addr, {"session": json.dumps(session)}) as sim:
            await sim.wait(lambda: bool(apps[0].state.hub.sessions.live), within=10)
            t0 = int(time.time())
            for seq, digit in enumerate(DIGITS, start=2):
                await sim.dtmf(digit, seq)
            events = await _until(apps[0], lambda es: len(_dtmf(es)) == len(DIGITS))
            got = _dtmf(events)
            assert [e["event"] for e in got] == DIGITS
            assert all(t0 <= e["received_at"] <= int(time.time()) for e in got)
            # each digit became a user text item, in order, named by its event
            users = [
                e["item"]
                for e in events
                if e["type"] == "conversation.item.added" and e["item"]["role"] == "user"
            ]
            assert [u["content"][0]["text"] for u in users] == [dtmf_text(d) for d in DIGITS]
            assert [u["id"] for u in users] == [e["item_id"] for e in got]
            # the model acts on the choice: the last digit is answered (the echo LLM reads
            # the user's last message); a digit interrupts the answer to the digits before
            # it, whose words stay in the conversation, so the answer reads them all
            events = await _until(
                apps[0],
                lambda es: any(
                    e["type"] == "response.done" and e["response"]["status"] == "completed"
                    for e in es
                ),
            )
            done = [e for e in events if e["type"] == "response.done"]
            assert done[-1]["response"]["status"] == "completed"
            heard = done[-1]["response"]["output"][0]["content"][0]["transcript"]
            texts = [dtmf_text(d) for d in DIGITS]
            assert heard.split("\n") in [texts[i:] for i in range(len(texts))], heard
            assert sim.media_in > 0  # ... and spoken to the caller
            # the SDK's decoder gives typed events
            typed = [decode_event(f) for f in _frames(apps[0])]
            keys = [e for e in typed if isinstance(e, ev.DtmfEventReceived)]
            assert [k.event for k in keys] == DIGITS and keys[0].item_id == users[0]["id"]
            await sim.stop()

    with running_server(path, apps=apps) as addr:
        asyncio.run(run())


def test_dtmf_without_dtmf_as_text_is_an_event_only(tmp_path: Path) -> None:
    apps: list[Any] = []
    path = write_config(tmp_path, engine=ECHO_LLM)

    async def run() -> None:
        async with TwilioSim.call(addr) as sim:
            await sim.wait(lambda: bool(apps[0].state.hub.sessions.live), within=10)
            for seq, digit in enumerate(DIGITS, start=2):
                await sim.dtmf(digit, seq)
            await sim.send({"event": "dtmf", "streamSid": sim.sid, "dtmf": {"digit": "12"}})
            events = await _until(apps[0], lambda es: len(_dtmf(es)) == len(DIGITS))
            await asyncio.sleep(0.3)
            events = _events(apps[0])
            assert [e["event"] for e in _dtmf(events)] == DIGITS  # "12" is no key: dropped
            assert all(e["item_id"] is None for e in _dtmf(events))
            kinds = {e["type"] for e in events}
            assert "conversation.item.added" not in kinds and "response.created" not in kinds
            await sim.stop()

    with running_server(path, apps=apps) as addr:
        asyncio.run(run())
