"""The words of the user's speech over an answer, for the interruption decision.

The session core asks for them (:class:`~duplex_server.protocol.commands.TranscribeSpeech`,
protocol/barge_in.py) when such a speech falls quiet; :class:`SpeechWords` runs the engine's
ASR stage on its audio as a batch transcription job (``engine.generate``: the route
``/v1/audio/transcriptions`` takes, at batch priority) and hands the words back to the core
(``ClientInput.speech_words``). The job asks for the hum check (``TranscribeJob.hums``):
Whisper writes a hum it took for words ("in a mom.") as "Mm-hmm.", so a listener's hum on a
phone line is a backchannel, not an interruption (docs/protocol.md §6.1). Best effort: a job
that fails gives no words (the core then judges on acoustics, as it does when they come
late); one per speech at a time (a newer speech's job replaces an older one's), and all are
cancelled when the session ends.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable

from duplex_contract.audio import INPUT_RATE
from duplex_contract.batch import TranscribeJob, TranscriptOut
from duplex_contract.errors import EngineError
from duplex_server.protocol.commands import Action, Call, Send, TranscribeSpeech
from duplex_server.protocol.machine import SessionMachine
from duplex_server.session.engine_calls import EngineSessions
from duplex_server.session.latest_job import LatestJob

log = logging.getLogger(__name__)


class SpeechWords(LatestJob):
    """One session's transcriptions of speech over its answers."""

    def __init__(
        self,
        engine: EngineSessions,
        core: SessionMachine,
        apply: Callable[[list[Action]], None],
        clock: Callable[[], float],
    ) -> None:
        super().__init__(apply)
        self.engine = engine
        self.core = core
        self.clock = clock

    def ask(self, action: TranscribeSpeech) -> None:
        """Transcribe ``action``'s audio; its words go to the core when known."""
        self.start(self._run(action), f"words:{self.core.session_id}:{action.speech}")

    async def _run(self, action: TranscribeSpeech) -> None:
        language = self.core.config.language
        job = TranscribeJob(audio=action.pcm, sample_rate=INPUT_RATE, language=language, hums=True)
        words: list[str] = []
        asked = self.clock()
        try:
            async for item in self.engine.generate(job):
                if isinstance(item, TranscriptOut):
                    words.append(item.text)
        except EngineError as exc:  # (e.g. server_busy: the batch queue is full)
            log.info("%s: speech not transcribed: %s", self.core.session_id, exc)
            words = []
        core = self.core
        if core.closed:
            return
        text, config = "".join(words), core.config
        actions = core.input.speech_words(action.speech, text, config, self.clock())
        log.debug(
            "%s: words of speech %d after %.0f ms: %r -> %s",
            core.session_id,
            action.speech,
            self.clock() - asked,
            text,
            _what(actions),
        )
        self.apply(actions)


def _what(actions: list[Action]) -> str:
    """What the words did, for the log: the events sent and the other actions, runs of
    one kind counted (none: the answer goes on as it was)."""
    names: list[str] = []
    for a in actions:
        if isinstance(a, Send):
            names.append(str(a.event.__struct_config__.tag))
        elif isinstance(a, Call):
            names.append(f"Call({type(a.command).__name__})")
        else:
            names.append(type(a).__name__)
    runs = [(k, len(list(g))) for k, g in itertools.groupby(names)]
    return ", ".join(k if n == 1 else f"{k} x{n}" for k, n in runs) or "nothing"
