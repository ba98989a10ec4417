"""SpeechWords (duplex_server/session/speech_words.py): the words of a speech over an answer
are asked of the engine as a batch transcription with the hum check on, so Whisper writes a
hum it took for words as "Mm-hmm." (docs/protocol.md §6.1)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

from duplex_contract.batch import BatchItem, TranscribeJob, TranscriptOut
from duplex_server.protocol.commands import Action, TranscribeSpeech
from duplex_server.session.speech_words import SpeechWords


class Engine:
    def __init__(self) -> None:
        self.jobs: list[Any] = []

    async def generate(self, job: Any) -> AsyncIterator[BatchItem]:
        self.jobs.append(job)
        yield TranscriptOut(request_id="r", text="Mm-hmm.", final=True)


def test_the_words_of_a_speech_over_an_answer_are_asked_with_the_hum_check() -> None:
    async def main() -> tuple[Engine, list[list[Action]]]:
        engine, applied = Engine(), []
        words_of: list[tuple[int, str]] = []

        def speech_words(number: int, text: str, config: Any, now: float) -> list[Action]:
            words_of.append((number, text))
            return []

        core = SimpleNamespace(
            session_id="s1",
            closed=False,
            config=SimpleNamespace(language="en"),
            input=SimpleNamespace(speech_words=speech_words),
        )
        words = SpeechWords(engine, core, applied.append, lambda: 0.0)  # type: ignore[arg-type]
        words.ask(TranscribeSpeech(3, b"\0\0" * 1600))
        for _ in range(100):  # (the job runs in a task of its own)
            if words_of:
                break
            await asyncio.sleep(0.01)
        await words.aclose()
        assert words_of == [(3, "Mm-hmm.")]
        return engine, applied

    engine, applied = asyncio.run(main())
    (job,) = engine.jobs
    assert isinstance(job, TranscribeJob) and job.hums and job.language == "en"
    assert applied == [[]]


def test_the_debug_log_says_the_words_and_what_they_did(caplog: Any) -> None:
    """``--log-level debug``: each speech's words and the verdict they led to, so a wrong
    cut can be traced to what the transcription said (bench/turn_taking.py
    --server-log-level debug)."""
    import logging

    from duplex_server.protocol import events as ev
    from duplex_server.protocol.commands import Send, SendAudio

    resumed = ev.OutputAudioResumed(response_id="r1", item_id="i1", audio_start_ms=1200)
    audio = SendAudio("r1", "i1", 0, b"\0\0" * 240, 24000, 1200.0, 10.0)

    async def main() -> None:
        def speech_words(number: int, text: str, config: Any, now: float) -> list[Action]:
            return [Send(resumed), audio, audio]

        core = SimpleNamespace(
            session_id="s1",
            closed=False,
            config=SimpleNamespace(language="en"),
            input=SimpleNamespace(speech_words=speech_words),
        )
        applied: list[list[Action]] = []
        words = SpeechWords(Engine(), core, applied.append, lambda: 0.0)  # type: ignore[arg-type]
        words.ask(TranscribeSpeech(4, b"\0\0" * 1600))
        for _ in range(100):
            if applied:
                break
            await asyncio.sleep(0.01)
        await words.aclose()
        assert applied == [[Send(resumed), audio, audio]]

    with caplog.at_level(logging.DEBUG, logger="duplex_server.session.speech_words"):
        asyncio.run(main())
    (line,) = [r.getMessage() for r in caplog.records if "words of speech" in r.getMessage()]
    assert line.startswith("s1: words of speech 4 after ")
    assert line.endswith(": 'Mm-hmm.' -> output_audio_buffer.resumed, SendAudio x2"), line
