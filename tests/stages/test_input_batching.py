"""The input lanes of many sessions share worker-thread jobs, and their Silero chunks are
scored in batched onnxruntime calls: the same speech events as one session alone."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest

import audio_kit.vad as vad_mod
from duplex_server.protocol.codec import AudioFormat
from duplex_server.protocol.events import TurnDetection
from duplex_server.protocol.vad_events import VadEvent
from duplex_server.session.input_lane import InputLane, InputProcessor, InputScheduler

FMT = AudioFormat("pcm16", 16000)
TD = TurnDetection(silence_duration_ms=320, prefix_padding_ms=0)
FRAME = 640  # 20 ms of PCM16 at 16 kHz


def _alone(pcm: bytes) -> list[VadEvent]:
    proc = InputProcessor(FMT, TD, "silero")
    return proc.process(pcm, 0.0)[1]


@pytest.mark.models
def test_lanes_of_many_sessions_score_their_vad_chunks_together(
    beckett: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    asyncio.run(_many_sessions(beckett, monkeypatch))


async def _many_sessions(beckett: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    sizes: list[int] = []
    real = vad_mod.silero_batch

    def spy(items):  # type: ignore[no-untyped-def]
        sizes.append(len(items))
        return real(items)

    monkeypatch.setattr(vad_mod, "silero_batch", spy)
    n = 4
    # each session starts at its own point of the recording (out of phase)
    inputs = [beckett[i * 6400 :] for i in range(n)]
    got: list[list[VadEvent]] = [[] for _ in range(n)]
    pcm_out = [bytearray() for _ in range(n)]
    failures: list[BaseException] = []
    all_done = asyncio.Event()
    with ThreadPoolExecutor(1) as pool:
        sched = InputScheduler(pool, 1)
        lanes = []
        for i in range(n):

            def done(pcm: bytes, events: list[VadEvent], i: int = i) -> None:
                pcm_out[i] += pcm
                got[i].extend(events)
                if all(len(o) == len(x) for o, x in zip(pcm_out, inputs, strict=True)):
                    all_done.set()

            lane = InputLane(sched, "silero", 1 << 22, done, failures.append)
            lane.configure(FMT, TD)
            lanes.append(lane)
        longest = max(len(x) for x in inputs)
        for off in range(0, longest, FRAME):  # 20 ms frames, all sessions per tick
            for lane, pcm in zip(lanes, inputs, strict=True):
                if off < len(pcm):
                    assert lane.put(pcm[off : off + FRAME])
            await asyncio.sleep(0)
        async with asyncio.timeout(60):
            await all_done.wait()
    assert failures == []
    for i in range(n):
        assert bytes(pcm_out[i]) == inputs[i]  # 16 kHz PCM16 passes through unchanged
        assert got[i] == _alone(inputs[i]), i
        assert [e.__class__.__name__ for e in got[i]].count("VadStart") >= 5
    assert max(sizes) == n  # the sessions' chunks went through one call together


@pytest.mark.models
def test_a_failing_session_does_not_fail_the_others_in_its_batch(beckett: bytes) -> None:
    """A lane whose audio cannot be processed (a 0 Hz format: no resampler) fails alone;
    the other lanes of the same job get their events."""
    asyncio.run(_one_failing(beckett))


async def _one_failing(beckett: bytes) -> None:
    errors: list[BaseException] = []
    got: list[VadEvent] = []
    fed = bytearray()
    good_done, bad_done = asyncio.Event(), asyncio.Event()

    def good_out(pcm: bytes, events: list[VadEvent]) -> None:
        fed.extend(pcm)
        got.extend(events)
        if len(fed) == len(beckett):
            good_done.set()

    def bad_failed(exc: BaseException) -> None:
        errors.append(exc)
        bad_done.set()

    with ThreadPoolExecutor(1) as pool:
        sched = InputScheduler(pool, 1)
        good = InputLane(sched, "silero", 1 << 22, good_out, errors.append)
        bad = InputLane(sched, "silero", 1 << 22, lambda p, e: None, bad_failed)
        good.configure(FMT, TD)
        bad.configure(AudioFormat("pcm16", 0), TD)  # no resampler for 0 Hz: fails in the job
        assert good.put(beckett) and bad.put(beckett[:6400])
        async with asyncio.timeout(60):
            await good_done.wait()
            await bad_done.wait()
    assert len(errors) == 1 and "sample rate" in str(errors[0])
    assert got == _alone(beckett)
