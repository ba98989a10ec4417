"""The SDK against the real server on loopback: text turn, audio turn, barge-in, playback
ack, and a forced disconnect in the middle of a reply resumed with no gap or duplicate."""

from __future__ import annotations

import asyncio
import base64
import subprocess
import sys
import wave
from pathlib import Path
from typing import TypeVar

import numpy as np
import pytest
from duplex_client import DuplexClient, SessionEnded, SyncDuplexClient, to_pcm16
from duplex_client import events as ev

from duplex_server.protocol import events as protocol_events
from tests.client.proxy import CuttingProxy
from tests.server.harness import UNIT, silence, tone

E = TypeVar("E", bound=ev.ServerEvent)
ROOT = Path(__file__).resolve().parents[2]
REPLY = "Hello there. This is the deterministic test stage speaking, one word at a time."


def _url(addr: str) -> str:
    return f"ws://{addr}/v1/realtime"


async def _until(
    client: DuplexClient, kind: type[E], wait_s: float = 10.0
) -> tuple[E, list[ev.AnyServerEvent]]:
    seen: list[ev.AnyServerEvent] = []
    while True:
        event = await client.next_event(wait_s * UNIT)
        seen.append(event)
        if isinstance(event, kind):
            return event, seen


async def _text_session(addr: str) -> DuplexClient:
    client = await DuplexClient.connect(_url(addr))
    await client.update_session({"output_modalities": ["text"], "turn_detection": None})
    await _until(client, ev.SessionUpdated)
    return client


def test_text_turn_and_close(server: str) -> None:
    async def main() -> None:
        client = await _text_session(server)
        assert client.session_id.startswith("sess_")
        await client.send_text("hi")
        done, seen = await _until(client, ev.ResponseDone)
        assert done.response.status == "completed"
        text = "".join(e.delta for e in seen if isinstance(e, ev.TextDelta))
        assert text == REPLY
        await client.close()
        with pytest.raises(SessionEnded):
            while True:
                await client.next_event(5 * UNIT)

    asyncio.run(main())


def test_audio_turn_with_server_vad_paced(server: str) -> None:
    async def main() -> None:
        async with await DuplexClient.connect(_url(server)) as client:
            fmt = {"type": "audio/pcm", "rate": 16000}
            await client.update_session({"audio": {"input": {"format": fmt}}})
            await _until(client, ev.SessionUpdated)
            assert client.input_rate == 16000
            speech = np.frombuffer(tone(600, 24000), dtype="<i2").astype(np.float32) / 32768
            await client.send_audio(speech, 24000, realtime=True)  # float, resampled
            await client.send_audio(silence(900, 16000), realtime=True)
            done, seen = await _until(client, ev.ResponseDone, 20)
            kinds = [type(e) for e in seen]
            assert ev.SpeechStarted in kinds and ev.SpeechStopped in kinds
            transcript = next(e for e in seen if isinstance(e, ev.InputTranscriptCompleted))
            assert transcript.transcript == "what is the weather like today"
            audio = b"".join(
                base64.b64decode(e.delta) for e in seen if isinstance(e, ev.AudioDelta)
            )
            assert len(audio) == len(REPLY.split(" ")) * 24000 * 2 // 4  # 250 ms per word
            assert done.response.status == "completed"

    asyncio.run(main())


def test_barge_in_and_playback_ack(server: str) -> None:
    async def main() -> None:
        async with await _text_session(server) as client:
            await client.update_session({"output_modalities": ["audio"]})
            await _until(client, ev.SessionUpdated)
            await client.send_text("tell me something long")
            delta, _ = await _until(client, ev.AudioDelta)
            await client.ack_playback(delta.item_id, 100.0)
            ack, _ = await _until(client, ev.PlaybackAcknowledged)
            assert ack.played_ms <= 100.0
            await client.barge_in()
            done, seen = await _until(client, ev.ResponseDone)
            assert done.response.status == "cancelled"
            cleared = [e for e in seen if isinstance(e, ev.OutputAudioCleared)]
            after = await _drain(client, 0.5)
            assert cleared or any(isinstance(e, ev.OutputAudioCleared) for e in after)
            assert not any(isinstance(e, ev.AudioDelta) for e in after)

    asyncio.run(main())


async def _drain(client: DuplexClient, seconds: float) -> list[ev.AnyServerEvent]:
    got: list[ev.AnyServerEvent] = []
    try:
        while True:
            got.append(await client.next_event(seconds * UNIT))
    except TimeoutError:
        return got


def test_forced_disconnect_mid_reply_is_resumed_transparently(server: str) -> None:
    async def main() -> None:
        proxy = CuttingProxy(server)
        addr = await proxy.start()
        client = await DuplexClient.connect(_url(addr), heartbeat_s=0.2)
        try:
            await client.update_session({"turn_detection": None})
            await _until(client, ev.SessionUpdated)
            await client.send_text("hi")
            _, before = await _until(client, ev.AudioDelta)
            await asyncio.sleep(0.5)  # a few deltas in flight and a heartbeat ack sent
            proxy.cut()  # RST in the middle of the reply (the TTS speaks in real time)
            done, after = await _until(client, ev.ResponseDone, 20)
            assert done.response.status == "completed"
            assert client.resumes == 1 and proxy.connections == 2
            stream = before + after
            seqs = [e.server_event_seq for e in stream]
            assert seqs == sorted(set(seqs))  # in order, no duplicate
            # no gap: only session.resumed (consumed by the client) is missing
            missing = set(range(seqs[0], seqs[-1] + 1)) - set(seqs)
            assert len(missing) == client.resumes
            audio = b"".join(
                base64.b64decode(e.delta) for e in stream if isinstance(e, ev.AudioDelta)
            )
            assert len(audio) == len(REPLY.split(" ")) * 24000 * 2 // 4
            starts = [e.audio_start_ms for e in stream if isinstance(e, ev.AudioDelta)]
            assert starts == sorted(set(starts))
            # the session still works on the new socket
            await client.send_text("again")
            done, _ = await _until(client, ev.ResponseDone, 20)
            assert done.response.status == "completed"
        finally:
            await client.close()
            await proxy.close()

    asyncio.run(main())


def test_sync_wrapper(server: str) -> None:
    """Built like the async client (``connect``); the old constructor still works."""
    for client in (SyncDuplexClient.connect(_url(server)), SyncDuplexClient(_url(server))):
        with client:
            assert client.session_id.startswith("sess_")
            client.update_session({"output_modalities": ["text"], "turn_detection": None})
            client.send_text("hi")
            text = ""
            for event in client.events(timeout_s=10 * UNIT):
                if isinstance(event, ev.TextDelta):
                    text += event.delta
                if isinstance(event, ev.ResponseDone):
                    break
            assert text == REPLY


def test_sdk_exports_the_event_types() -> None:
    """User code imports only the SDK: ``duplex_client.events`` names every public type of
    the protocol's events module (the same classes, so isinstance checks hold)."""
    import duplex_client

    public = {
        name
        for name, value in vars(protocol_events).items()
        if not name.startswith("_")
        and getattr(value, "__module__", None) == protocol_events.__name__
    }
    assert public <= set(ev.__all__), sorted(public - set(ev.__all__))
    assert all(getattr(ev, n) is getattr(protocol_events, n) for n in ev.__all__)
    assert duplex_client.events is ev and "events" in duplex_client.__all__
    decoded = duplex_client.decode_event('{"type": "session.heartbeat_ack"}')
    assert isinstance(decoded, ev.HeartbeatAck)


def test_to_pcm16_conversions() -> None:
    ints = np.array([0, 1000, -1000], dtype=np.int16)
    assert to_pcm16(ints, 16000, 16000) == ints.astype("<i2").tobytes()
    floats = np.array([0.0, 0.5, -2.0], dtype=np.float32)
    assert np.frombuffer(to_pcm16(floats, 16000, 16000), "<i2").tolist() == [0, 16383, -32767]
    one_second = to_pcm16(np.zeros(24000, np.int16), 24000, 16000)
    assert len(one_second) == 32000


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "duplex_client.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60 * UNIT, cwd=ROOT)


def test_cli_talk_say_chat(server: str, tmp_path: Path) -> None:
    src = tmp_path / "in.wav"
    with wave.open(str(src), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(silence(200, 16000) + tone(700, 16000))
    out = tmp_path / "reply.wav"
    talk = _cli("--url", _url(server), "talk", "--wav", str(src), "--out", str(out), "--fast")
    assert talk.returncode == 0, talk.stderr
    assert "turn 1  you:       what is the weather like today" in talk.stdout
    assert f"turn 1  assistant: {REPLY}  [completed, TTFA " in talk.stdout
    assert "1 turn detected by server VAD, 1 transcript, 1 answer (1 completed)" in talk.stdout
    with wave.open(str(out)) as w:
        assert w.getframerate() == 24000 and w.getnframes() == len(REPLY.split(" ")) * 6000
    spoken = tmp_path / "say.wav"
    say = _cli("--url", _url(server), "say", "one two", "--out", str(spoken))
    assert say.returncode == 0, say.stderr
    with wave.open(str(spoken)) as w:
        assert w.getnframes() == 2 * 6000
    chat = _cli("--url", _url(server), "chat", "hi")
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout.strip() == f"assistant> {REPLY}"
