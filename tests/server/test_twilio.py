"""Twilio Media Streams (/v1/twilio) against the real server, with a peer that speaks the
documented protocol in real time (tests/server/twilio_sim.py)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import websockets

from duplex_server.transports.twilio import TwilioCall
from tests.server.harness import UNIT, http_text, running_server, write_config
from tests.server.test_session_memory import all_released, settle
from tests.server.twilio_sim import SendAfterDrop, TwilioSim, tone8k

#: replies of 15 words at 120 ms a word: 1.8 s of audio, sent faster than real time. Noise,
#: not the default tone: a pure tone is a degenerate far-end reference for the echo
#: canceller (it keeps suppressing the caller while a tone plays that does not echo).
SHORT_TTS = {"stages": {"tts": {"options": {"ms_per_word": 120.0, "audio": "noise"}}}}


def _journal(app: Any) -> list[dict[str, Any]]:
    """Every event the server's one live session stamped (the Twilio peer never sees them)."""
    (session,) = list(app.state.hub.sessions.live.values())
    frames = session.journal.replay_after(0, time.monotonic()) or []
    return [json.loads(f) for f in frames]


def test_twilio_call_marks_barge_in_truncation_and_stop(tmp_path: Path) -> None:
    apps: list[Any] = []
    path = write_config(tmp_path, engine=SHORT_TTS)

    async def run(addr: str) -> None:
        # the immediate rule: a tone says no word, and confirm (the default on a call) takes
        # a short one back (tests/server/test_turn_taking_media.py)
        td = {"interrupt_mode": "immediate"}
        session = {
            "instructions": "You answer phone calls.",
            "audio": {"input": {"turn_detection": td}},
        }
        params = {"session": json.dumps(session)}
        async with TwilioSim.call(addr, params) as sim:
            sim.speak(tone8k(500))
            await sim.wait(lambda: len(sim.marks_echoed) >= 3, within=10)
            first_item = sim.marks_in[0].rpartition(":")[0]
            assert first_item.startswith("item_")
            assert sim.clears == 0
            # the caller talks over the reply while it still plays: clear, then a new reply
            played_before = sim.played
            sim.speak(tone8k(500))
            await sim.wait(lambda: sim.clears == 1, within=5)
            heard_ms = sim.played / 16.0  # PCM16 at 8 kHz
            assert sim.played > played_before
            await sim.wait(lambda: any(not m.startswith(first_item) for m in sim.marks_in), 10)
            after = sim.received[[m["event"] for m in sim.received].index("clear") + 1 :]
            marks_after = [m["mark"]["name"] for m in after if m["event"] == "mark"]
            assert marks_after  # the new reply
            assert not [n for n in marks_after if n.startswith(first_item + ":")]
            await asyncio.sleep(0.3)
            events = _journal(apps[0])
            session = next(e for e in events if e["type"] == "session.updated")["session"]
            assert session["instructions"] == "You answer phone calls."
            assert session["audio"]["output"]["format"] == {"type": "audio/pcmu", "rate": 8000}
            assert session["audio"]["input"]["echo_cancellation"] is True
            (trunc,) = [e for e in events if e["type"] == "conversation.item.truncated"]
            assert trunc["item_id"] == first_item
            # truncated to what the caller heard: within the marks' granularity (100 ms chunks)
            assert heard_ms - 250 <= trunc["audio_end_ms"] <= heard_ms + 50
            assert trunc["audio_end_ms"] < 1800
            await sim.stop()
            await asyncio.wait_for(sim.closed.wait(), 5 * UNIT)
        await asyncio.sleep(0.2)
        assert not apps[0].state.hub.sessions.live  # stop ended the session

    with running_server(path, apps=apps) as addr:
        asyncio.run(run(addr))


def test_twilio_malformed_messages_are_logged_and_the_call_goes_on(tmp_path: Path) -> None:
    path = write_config(tmp_path, engine=SHORT_TTS)

    async def run(addr: str) -> None:
        async with TwilioSim.call(addr) as sim:
            for bad in ("not json", "[1, 2]", '{"event": "bogus"}', '{"event": "media"}'):
                await sim.ws.send(bad)
            await sim.send({"event": "media", "streamSid": sim.sid, "media": {"payload": "*"}})
            await sim.send({"event": "mark", "streamSid": sim.sid, "mark": {"name": "x"}})
            sim.speak(tone8k(500))
            await sim.wait(lambda: len(sim.marks_echoed) >= 2, within=10)
            assert not sim.closed.is_set()
        body = http_text(addr, "/metrics")
        line = next(x for x in body.splitlines() if 'code="twilio_malformed"' in x)
        assert float(line.split()[-1]) == 6.0

    with running_server(path) as addr:
        asyncio.run(run(addr))


def test_twilio_api_key_in_custom_parameters(tmp_path: Path) -> None:
    path = write_config(tmp_path, engine=SHORT_TTS, server={"api_keys": ["sk-phone"]})

    async def run(addr: str) -> None:
        async with TwilioSim.call(addr, {"api_key": "wrong"}) as sim:
            await asyncio.wait_for(sim.closed.wait(), 5 * UNIT)
            assert sim.ws.close_code == 1008
            assert sim.media_in == 0
        async with TwilioSim.call(addr, {"api_key": "sk-phone"}) as sim:
            sim.speak(tone8k(500))
            await sim.wait(lambda: sim.media_in > 0, within=10)
        headers = {"Authorization": "Bearer sk-phone"}
        async with websockets.connect(f"ws://{addr}/v1/twilio", additional_headers=headers):
            pass

    with running_server(path) as addr:
        asyncio.run(run(addr))


def test_twilio_call_gone_while_the_server_sends_ends_as_a_hangup(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """Twilio can vanish while the reply's media is being sent: the send fails. The call
    ends like a hang-up (session closed, its slot back), and the endpoint returns cleanly
    instead of failing the ASGI app with the send's disconnect error."""
    path = write_config(tmp_path, engine=SHORT_TTS)
    apps: list[Any] = []
    outcomes: list[BaseException | None] = []
    real_serve = TwilioCall.serve
    held = SendAfterDrop(monkeypatch, armed=True)

    async def serve(self: TwilioCall) -> None:
        try:
            await real_serve(self)
        except BaseException as exc:
            outcomes.append(exc)
            raise
        outcomes.append(None)

    monkeypatch.setattr(TwilioCall, "serve", serve)

    async def run(addr: str) -> None:
        async with TwilioSim.call(addr, {}) as sim:
            sim.speak(tone8k(500))
            await sim.wait(lambda: sim.media_in >= 2, within=10)
            sim.ws.transport.abort()
        await settle(addr, {})
        await all_released(addr)

    with running_server(path, apps=apps) as addr:
        asyncio.run(run(addr))
        assert held.held == 1  # a send ran (and failed) after the drop
        assert outcomes == [None]
        assert not apps[0].state.hub.sessions.live
