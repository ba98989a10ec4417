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


def test_echo_control_unit_cancels_guards_and_passes_speech() -> None:
    """EchoControl alone: broadband far end, its echo 120 ms later at -6 dB in the mic."""
    import numpy as np

    from audio_kit.echo import EchoControl

    rate = 16000
    rng = np.random.default_rng(0)
    far = (rng.standard_normal(rate * 4) * 2000).astype("<i2")
    delay = int(0.12 * rate)
    echo = np.zeros(far.size)
    echo[delay:] = far[:-delay] * 0.5
    near = np.zeros(far.size)
    t = np.arange(rate) / rate
    near[3 * rate :] = np.sin(2 * np.pi * 300 * t) * 0.3 * 32767  # the caller, in second 4

    def rms(a: np.ndarray) -> float:
        return float(np.sqrt(np.mean(a.astype(np.float64) ** 2)))

    ec = EchoControl()
    ec.playing(far.tobytes())
    mic = np.clip(echo + near, -32768, 32767).astype("<i2")
    out = b"".join(ec.process(mic[i : i + 320].tobytes()) for i in range(0, 3 * rate, 320))
    assert 0.35 < ec.echo_ratio < 0.65  # the echo is -6 dB: learned as such
    out += b"".join(ec.process(mic[i : i + 320].tobytes()) for i in range(3 * rate, mic.size, 320))
    cleaned = np.frombuffer(out, dtype="<i2")
    assert cleaned.size == mic.size
    assert rms(echo[rate : 3 * rate]) > 900
    assert rms(cleaned[rate : 3 * rate]) < 10  # echo gone (cancelled, then guarded)
    assert ec.guarded_frames > 0
    assert rms(cleaned[3 * rate + 1600 :]) > 0.5 * rms(near[3 * rate :])  # speech passes
    # the far end reports playout far ahead of the reference: it skips forward (to the
    # mark's position + half a media frame); a reference ahead of playout moves back
    ec2 = EchoControl()
    ec2.playing(far.tobytes())
    ec2.played_through(rate)
    assert len(ec2._ref) == (far.size - rate - 160) * 2
    ec2.process(b"\x00\x00" * 1600)  # 100 ms of input
    ec2.played_through(rate)  # ... but the far end is where it was: 100 ms back
    assert len(ec2._ref) == (far.size - rate - 160) * 2
    ec2.played_through(rate + 100)  # within a media frame: left alone
    assert len(ec2._ref) == (far.size - rate - 160) * 2
    ec2.flush()
    assert not ec2._ref


def test_echo_cancellation_session_field() -> None:
    import pytest

    from duplex_server.media import check_session_patch
    from duplex_server.protocol.codec import decode_client_event
    from duplex_server.protocol.config import EffectiveSession, apply_patch
    from duplex_server.protocol.errors import ProtocolError

    update = {"type": "session.update", "session": {"audio": {"input": {}}}}
    update["session"]["audio"]["input"]["echo_cancellation"] = True
    event = decode_client_event(json.dumps(update))
    on = apply_patch(EffectiveSession(), event.session)  # type: ignore[union-attr]
    assert on.echo_cancellation is True
    assert on.to_wire("sess_x").audio.input.echo_cancellation is True
    assert EffectiveSession().to_wire("sess_x").audio.input.echo_cancellation is False
    with pytest.raises(ProtocolError) as err:
        check_session_patch({"audio": {"input": {"echo_cancellation": "yes"}}})
    assert "echo_cancellation" in str(err.value)


def test_echo_control_without_echo_the_guard_fades() -> None:
    """A headset: the bot's playout (speech, here the test WAV) never reaches the
    microphone. The guard's learned echo level fades, and a caller can still interrupt.
    (Stationary noise as the far end would not do: AEC3 suppresses a near end that has no
    echo path while such a far end plays.)"""
    import numpy as np
    import soundfile
    import soxr

    from audio_kit.echo import GUARD_RATIO, EchoControl
    from tests.server.harness import ROOT

    rate = 16000
    wav, wav_rate = soundfile.read(ROOT / "tests/data/beckett.wav", dtype="float32")
    speech = soxr.resample(wav, wav_rate, rate)[: rate * 4]
    far = (speech / np.sqrt(np.mean(speech**2)) * 2000).clip(-32768, 32767).astype("<i2")
    ec = EchoControl()
    ec.playing(far.tobytes())
    quiet = np.zeros(rate * 3, dtype="<i2")
    for i in range(0, quiet.size, 320):
        ec.process(quiet[i : i + 320].tobytes())
    assert ec.echo_ratio < 0.15  # no echo heard: from -6 dB down to about the floor
    assert GUARD_RATIO == 0.2
    t = np.arange(rate // 2) / rate
    voice = (np.sin(2 * np.pi * 300 * t) * 2800).astype("<i2")  # RMS ~2000, the bot's level
    out = np.frombuffer(ec.process(voice.tobytes()), dtype="<i2")
    assert np.sqrt(np.mean(out[rate // 4 :].astype(np.float64) ** 2)) > 1000
