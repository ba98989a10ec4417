"""Transcript parity: human recordings streamed through a live session (server VAD, pause
speculation, per-frame resampling) transcribe as well as the same audio sent to the batch
route ``POST /v1/audio/transcriptions`` (WER within +0.02), with the real CPU models."""

from __future__ import annotations

import asyncio
import io
import os
import time

import httpx
import jiwer
import numpy as np
import pytest
import soundfile

from audio_kit.g711 import pcm16_to_g711
from audio_kit.pcm import resample_pcm16
from tests.server.harness import ROOT, UNIT, Client, running_server, silence

pytestmark = pytest.mark.models

# tests/data/README.md: the recordings and their reference texts
RECORDINGS = {
    "two_cities.wav": "It was the best of times, it was the worst of times, it was the age of "
    "wisdom, it was the age of foolishness.",
    "beckett.wav": "Ever tried. Ever failed. No matter. Try again. Fail again. Fail better.",
}


def _norm(text: str) -> str:
    keep = "".join(c.lower() if c.isalnum() or c == "'" else " " for c in text)
    return " ".join(keep.split()) or "<empty>"


def _wer(ref: str, hyp: str) -> float:
    return float(jiwer.wer(_norm(ref), _norm(hyp)))


async def _live(
    addr: str,
    pcm: bytes,
    rate: int,
    chunk_ms: int = 20,
    speed: float = 1.0,
    codec: str = "pcm16",
) -> str:
    """Binary 20 ms frames in real time, as from a microphone (the VAD and the pause
    speculation see the same stream); the transcripts of all turns, in order.
    ``codec="g711_ulaw"``: ``pcm`` (8 kHz) is sent as G.711 mu-law (``audio/pcmu``).

    On a busy machine Whisper can fall behind the speaker (the engine refuses a fifth
    pending turn): the microphone then waits while two turns are in transcription. The VAD
    judges samples, not wall-clock time, so this changes no cut point."""
    async with Client.connect(addr) as c:
        await c.until("session.created", within=30)
        fmt: dict[str, object] = {"type": "audio/pcm", "rate": rate}
        if codec == "g711_ulaw":
            fmt = {"type": "audio/pcmu"}
        td = {"type": "server_vad", "create_response": False}
        await c.send(
            {
                "type": "session.update",
                "session": {
                    "output_modalities": ["text"],
                    "audio": {"input": {"format": fmt, "turn_detection": td}},
                },
            }
        )
        await c.until("session.updated", within=10)
        texts: dict[str, str] = {}
        order: list[str] = []
        sent = asyncio.Event()

        async def reader() -> None:
            while not (sent.is_set() and order and all(i in texts for i in order)):
                try:  # wake now and then: the last transcript may come before the end
                    ev = await c.recv(within=0.5)  # of the stream (fast ASR)
                except TimeoutError:
                    continue
                assert ev["type"] != "error", ev
                if ev["type"] == "input_audio_buffer.committed":
                    order.append(ev["item_id"])
                elif ev["type"] == "conversation.item.input_audio_transcription.completed":
                    texts[ev["item_id"]] = ev["transcript"]

        task = asyncio.create_task(reader())
        stream = silence(300, rate) + pcm + silence(1500, rate)
        step = rate * chunk_ms // 1000 * 2
        if codec == "g711_ulaw":
            stream, step = pcm16_to_g711(stream, "g711_ulaw"), step // 2
        t = time.monotonic()
        for i in range(0, len(stream), step):
            while len(order) - len(texts) >= 2 and not task.done():
                await asyncio.sleep(0.05)
                t = time.monotonic()
            await c.ws.send(stream[i : i + step])
            t += chunk_ms / 1000 / speed
            await asyncio.sleep(max(0.0, t - time.monotonic()))
        sent.set()  # the 1.5 s of silence at the end committed the last turn
        await asyncio.wait_for(task, 120 * UNIT)
        return " ".join(texts[i] for i in order)


def _batch(addr: str, name: str, samples: np.ndarray, rate: int) -> str:
    """``POST /v1/audio/transcriptions`` of these PCM16 samples as a WAV file."""
    wav = io.BytesIO()
    soundfile.write(wav, samples, rate, format="WAV", subtype="PCM_16")
    r = httpx.post(
        f"http://{addr}/v1/audio/transcriptions",
        files={"file": (name, wav.getvalue(), "audio/wav")},
        data={"model": "whisper"},
        timeout=60 * UNIT,
    )
    assert r.status_code == 200, r.text
    return str(r.json()["text"])


def test_streamed_transcripts_are_as_accurate_as_batch() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with running_server(ROOT / "configs" / "cpu.yaml", ready_s=300) as addr:
        for (name, ref), rate in zip(RECORDINGS.items(), (24000, 16000), strict=True):
            data, file_rate = soundfile.read(ROOT / "tests" / "data" / name, dtype="int16")
            batch = _batch(addr, name, data, file_rate)
            live = asyncio.run(_live(addr, resample_pcm16(data.tobytes(), file_rate, rate), rate))
            assert _wer(ref, live) <= _wer(ref, batch) + 0.02, (name, live, batch)
            assert _wer(ref, live) <= 0.25, (name, live)


@pytest.mark.long  # the append sizes: make test-long (the formats: test-matrix)
def test_the_live_transcript_does_not_depend_on_the_append_size() -> None:
    """The same recording streamed in appends of 10, 100 and 200 ms (faster than real time:
    the VAD judges samples, and the ASR context's gap is read on the input clock) gives the
    same live transcript, as good as the batch route's. The 24 kHz input is resampled by the
    session's stream resampler, whose int16 output used to carry random dither, so the
    transcript changed with the append size ("Failed better" with 100 ms appends)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    name, ref = "beckett.wav", RECORDINGS["beckett.wav"]
    data, file_rate = soundfile.read(ROOT / "tests" / "data" / name, dtype="int16")
    pcm = resample_pcm16(data.tobytes(), file_rate, 24000)
    with running_server(ROOT / "configs" / "cpu.yaml", ready_s=300) as addr:
        batch = _batch(addr, name, np.frombuffer(pcm, "<i2"), 24000)
        lives = {ms: asyncio.run(_live(addr, pcm, 24000, ms, speed=4.0)) for ms in (10, 100, 200)}
    assert len(set(lives.values())) == 1, lives
    live = lives[10]
    assert _wer(ref, live) <= _wer(ref, batch) + 0.02, (live, batch)
