"""The rule by which a commit adopts a pause's speculative transcript
(``engine.orchestration.speculation.Transcription.covers``): the turn's audio starts with the
guess's and
the VAD heard no speech since (the guess survived: ``input.resume`` drops it). Sound the VAD
did not call speech (a breath, room noise) does not void the guess; its energy is not judged."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import numpy as np

from audio_kit.pcm import quiet_after
from duplex_contract.fence import Fence
from engine.orchestration.speculation import SpeculativeAsr, Transcription
from engine.pipeline.pipeline import Pipeline

RATE = 16000


def _pcm(x: np.ndarray) -> bytes:
    return bytes((np.clip(x, -1, 1) * 32767).astype("<i2").tobytes())


def _speech(seconds: float, level: float = 0.3) -> np.ndarray:
    t = np.arange(int(RATE * seconds)) / RATE
    return level * np.sin(2 * np.pi * 220 * t) * (0.6 + 0.4 * np.sin(2 * np.pi * 4 * t))


def _noise(seconds: float, level: float, seed: int = 0) -> np.ndarray:
    return level * np.random.default_rng(seed).standard_normal(int(RATE * seconds))


async def _guess(audio: bytes) -> Transcription:
    task = asyncio.create_task(asyncio.sleep(0, result="ever tried"))
    await task
    return Transcription("pause", audio, task)


def test_a_guess_covers_a_turn_that_only_adds_what_the_vad_did_not_call_speech() -> None:
    """beckett.wav-like: room noise at ~3 % of the speech's peak and a breath at -12 dB
    after the pause. The old rule (energy under -40 dB of the speech) refused the guess."""

    async def main() -> None:
        room = _noise(2.0, 0.006, seed=1)
        speech = _speech(1.0) + room[:RATE]
        head = _pcm(np.concatenate([speech, room[RATE : RATE + RATE // 10]]))  # + 96 ms
        breath = _noise(0.2, 0.07, seed=2)  # -12 dB of the speech's loudest window
        tail = _pcm(np.concatenate([room[: RATE // 5] + breath, room[: RATE // 5]]))
        turn = head + tail
        assert not quiet_after(turn, len(head))  # loud enough to fail the energy rule
        guess = await _guess(head)
        assert guess.covers(turn)
        assert guess.covers(head)  # committed right at the guess

    asyncio.run(main())


def test_a_guess_does_not_cover_other_audio() -> None:
    async def main() -> None:
        head = _pcm(_speech(0.5))
        guess = await _guess(head)
        assert not guess.covers(head[:-2])  # a shorter turn
        assert not guess.covers(_pcm(_speech(0.5, 0.2)) + bytes(3200))  # other words
        turn_asr = Transcription("turn", head, guess.task)
        assert turn_asr.covers(head)
        assert not turn_asr.covers(head + bytes(2))  # a turn's own ASR: the same audio only

    asyncio.run(main())


class _Pipeline:
    """The one call SpeculativeAsr makes: it records the audio of each transcription."""

    def __init__(self) -> None:
        self.heard: list[bytes] = []

    async def transcribe(self, request_id: str, audio: bytes, **_: Any) -> str:
        self.heard.append(audio)
        return f"words of {len(audio)} bytes"


def _spec() -> tuple[SpeculativeAsr, _Pipeline]:
    pipe = _Pipeline()
    spec = SpeculativeAsr(
        cast(Pipeline, pipe),
        RATE,
        track=lambda task: None,
        route_of=lambda sid: "transcribe",
        language_of=lambda sid: "en",
    )
    return spec, pipe


def test_a_commit_transcribes_up_to_a_pause_that_was_not_guessed() -> None:
    """A pause the policy did not guess (``skip``: the session's previous turn was still
    running): the commit transcribes the audio up to that pause, the audio a guess would
    have had, so whether a guess ran (the load decides) does not change the words."""

    async def main() -> None:
        spec, pipe = _spec()
        fence = Fence("s", 0, 1, 0)
        head = _pcm(_speech(1.0))
        turn = head + _pcm(_noise(0.5, 0.02))  # not speech to the VAD: no input.resume
        spec.skip("s", head)
        spec.committed("s", turn, None)
        assert await spec.transcript(fence, turn) == f"words of {len(head)} bytes"
        assert pipe.heard == [head] and spec.used == 0
        # speech resumed after the pause: the whole turn is transcribed
        spec.skip("s", head)
        spec.resume("s")
        later, longer = Fence("s", 0, 2, 0), turn + head
        spec.committed("s", longer, None)  # (the job's own audio object, as the engine's)
        await spec.transcript(later, longer)
        assert pipe.heard[-1] == longer

    asyncio.run(main())


def test_a_commit_adopts_the_guess_of_its_last_pause() -> None:
    async def main() -> None:
        spec, pipe = _spec()
        fence = Fence("s", 0, 1, 0)
        head = _pcm(_speech(1.0))
        spec.start(fence, head, respond=False)
        turn = head + _pcm(_noise(0.5, 0.05))  # a breath, -15 dB: the VAD heard no speech
        spec.committed("s", turn, None)
        assert await spec.transcript(fence, turn) == f"words of {len(head)} bytes"
        assert pipe.heard == [head] and spec.used == 1

    asyncio.run(main())
