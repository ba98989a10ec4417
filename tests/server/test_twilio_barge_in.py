"""A phone call obeys the session core's barge-in guards: the caller talking over a reply
that is over (``response.done``) but still playing at Twilio clears it only as a barge-in
on a response in progress would (``min_interrupt_speech_ms``, ``uninterruptible_ms``,
``interrupt_response``; docs/protocol.md §6 and §12)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from tests.server.harness import running_server, write_config
from tests.server.twilio_sim import TwilioSim, tone8k

#: replies of 15 words at 300 ms a word: 4.5 s of audio, sent faster than real time, so the
#: response is done while most of it still plays at the far end (noise: see test_twilio.py)
LONG_TTS = {"stages": {"tts": {"options": {"ms_per_word": 300.0, "audio": "noise"}}}}


def _events(app: Any) -> list[dict[str, Any]]:
    (session,) = list(app.state.hub.sessions.live.values())
    frames = session.journal.replay_after(0, time.monotonic()) or []
    return [json.loads(f) for f in frames]


async def _talk_over(
    app: Any, addr: str, guards: dict[str, Any]
) -> tuple[int, list[dict[str, Any]]]:
    """A call: one turn, then 600 ms of speech over its reply once the response is done
    and while its audio plays; the clears Twilio got, and the session's events."""
    # the immediate rule's guards (confirm, the default on a call, pauses at the onset)
    td = {"type": "server_vad", "interrupt_mode": "immediate", **guards}
    session = {"audio": {"input": {"turn_detection": td}}}
    async with TwilioSim.call(addr, {"session": json.dumps(session)}) as sim:
        sim.speak(tone8k(500))
        # the reply is over (its audio is all sent, faster than real time) and playing; on
        # a loaded machine the TTS may lag Twilio's marks, so wait for both, not a count
        await sim.wait(
            lambda: (
                len(sim.marks_echoed) >= 3 and "response.done" in [e["type"] for e in _events(app)]
            ),
            within=10,
        )
        types = [e["type"] for e in _events(app)]
        assert sim.playout  # ... and Twilio still has reply audio to play
        stopped = types.count("input_audio_buffer.speech_stopped")
        sim.speak(tone8k(600))

        def spoke() -> bool:
            later = [e["type"] for e in _events(app)]
            return later.count("input_audio_buffer.speech_stopped") > stopped

        await sim.wait(spoke, within=10)
        await asyncio.sleep(0.3)  # a clear decided at the end of speech has reached Twilio
        events = _events(app)
        clears = sim.clears
        await sim.stop()
    return clears, events


def test_talking_over_a_finished_reply_obeys_the_barge_in_guards(tmp_path: Path) -> None:
    path = write_config(tmp_path, engine=LONG_TTS)
    apps: list[Any] = []

    async def run(addr: str) -> None:
        app = apps[0]
        # 600 ms of speech is shorter than min_interrupt_speech_ms: the reply plays on
        clears, events = await _talk_over(app, addr, {"min_interrupt_speech_ms": 1500})
        assert clears == 0
        assert not [e for e in events if e["type"] == "output_audio_buffer.cleared"]
        assert not [e for e in events if e["type"] == "conversation.item.truncated"]
        # inside the reply's uninterruptible window (from its start): the same
        clears, _ = await _talk_over(app, addr, {"uninterruptible_ms": 60_000})
        assert clears == 0
        clears, _ = await _talk_over(app, addr, {"interrupt_response": False})
        assert clears == 0
        # long enough and past the window: cleared, once, for the reply that was playing
        clears, events = await _talk_over(app, addr, {"min_interrupt_speech_ms": 300})
        assert clears == 1
        (cleared,) = [e for e in events if e["type"] == "output_audio_buffer.cleared"]
        first = next(e for e in events if e["type"] == "response.done")["response"]["id"]
        assert cleared["response_id"] == first
        assert [e for e in events if e["type"] == "conversation.item.truncated"]

    with running_server(path, apps=apps) as addr:
        asyncio.run(run(addr))
