"""Echo control over /v1/twilio: a speakerphone caller whose microphone hears the bot's own
playout 120 ms later at -6 dB, against the real server."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from tests.server.harness import running_server, write_config
from tests.server.twilio_sim import TwilioSim, tone8k

#: 10-word replies (1 s at 100 ms a word); broadband noise stands in for speech (see
#: test_twilio.SHORT_TTS)
TTS = {"stages": {"tts": {"options": {"ms_per_word": 100.0, "audio": "noise"}}}}
LONG_TTS = {"stages": {"tts": {"options": {"ms_per_word": 250.0, "audio": "noise"}}}}


def _items(sim: TwilioSim) -> list[str]:
    out: list[str] = []
    for name in sim.marks_in:
        item = name.rpartition(":")[0]
        if item not in out:
            out.append(item)
    return out


def _params(echo: bool) -> dict[str, str]:
    return {"session": json.dumps({"audio": {"input": {"echo_cancellation": echo}}})}


async def _turn(sim: TwilioSim, n: int) -> None:
    """The caller asks (0.4 s), then stays silent while reply ``n`` plays and echoes."""
    sim.speak(tone8k(400))
    await sim.wait(lambda: len(_items(sim)) >= n, within=10)
    await sim.wait(lambda: len(sim.marks_echoed) == len(sim.marks_in) and not sim.playout, 10)
    await asyncio.sleep(0.8)  # the echo tail and the VAD's silence window


def test_echo_control_on_no_self_interruption_over_five_replies(tmp_path: Path) -> None:
    path = write_config(tmp_path, engine=TTS)

    async def run(addr: str) -> None:
        async with TwilioSim.call(addr, _params(True), echo_delay_ms=120, echo_gain=0.5) as sim:
            for n in range(1, 6):
                await _turn(sim, n)
                assert sim.clears == 0, f"self-interruption during reply {n}"
            assert len(_items(sim)) == 5  # five replies, none to the bot's own voice

    with running_server(path) as addr:
        asyncio.run(run(addr))


def test_echo_control_off_the_bot_interrupts_itself(tmp_path: Path) -> None:
    path = write_config(tmp_path, engine=TTS)

    async def run(addr: str) -> None:
        async with TwilioSim.call(addr, _params(False), echo_delay_ms=120, echo_gain=0.5) as sim:
            sim.speak(tone8k(400))
            await sim.wait(lambda: sim.clears >= 1, within=10)  # its own echo barged in

    with running_server(path) as addr:
        asyncio.run(run(addr))


def test_echo_control_real_speech_over_the_echo_still_interrupts(tmp_path: Path) -> None:
    path = write_config(tmp_path, engine=LONG_TTS)

    async def run(addr: str) -> None:
        async with TwilioSim.call(addr, _params(True), echo_delay_ms=120, echo_gain=0.5) as sim:
            sim.speak(tone8k(400))
            await sim.wait(lambda: len(sim.marks_echoed) >= 10, within=10)  # 1 s playing
            assert sim.clears == 0
            sim.speak(tone8k(500))  # the caller talks over the bot (and its echo)
            await sim.wait(lambda: sim.clears == 1, within=5)

    with running_server(path) as addr:
        asyncio.run(run(addr))
