"""User transcriptions that outlive the turn job that asked for them.

* Speculative ASR: the server signals ``input.pause`` once a short silence starts inside
  speech, and the transcript of the input so far is usually ready when the silence window
  ends the turn. A commit uses it when its audio starts with the speculated audio (only
  silence was appended since); ``input.resume`` drops it. A guess runs at
  ``Priority.SPECULATIVE``: behind every committed turn's ASR, so that on a loaded ASR stage
  the guesses (up to one per pause in the user's speech) never delay a turn; a queued guess
  that the user's next words make stale is aborted before it runs.
* Turn ASR survives a barge-in: a cancel aborts the old epoch's LLM and TTS work, but the
  user's words are re-queued in the new epoch (engine/duplex/control.py), and their
  transcription, already running, is picked up by the re-queued job (same audio) instead of
  starting again. So ASR request ids carry the session and turn but not the epoch
  (``sess_x/asr/t5/3``); a close still aborts them (session prefix).

* Context: each turn is transcribed after the same session's previous turn (its audio and
  transcript ride on the ASR request), so a short turn cut by the VAD ("Ever failed.") is
  decoded with the words around it, as the batch route decodes one whole recording.

Runs on the orchestrator loop; the ASR itself runs in its stage.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from engine.audio import quiet_after
from engine.errors import StageError
from engine.messages import Fence, Priority
from engine.pipeline import Pipeline

log = logging.getLogger(__name__)
_PER_SESSION = 4


@dataclass(eq=False)
class _Transcription:
    kind: Literal["pause", "turn"]
    audio: bytes
    task: asyncio.Task[str]
    claimed: bool = False  # a turn job awaits it: never discarded under that job

    def covers(self, audio: bytes) -> bool:
        if self.kind == "pause":  # the commit may add trailing silence, and only silence:
            # quiet speech after the pause that the VAD did not call speech (a soft last
            # word) would be missing from the guess, so then the turn is transcribed again
            return audio.startswith(self.audio) and quiet_after(audio, len(self.audio))
        return audio == self.audio


class SpeculativeAsr:
    def __init__(
        self,
        pipeline: Pipeline,
        sample_rate: int,
        track: Callable[[asyncio.Task[Any]], None],
        route_of: Callable[[str], str],
    ) -> None:
        self._pipeline = pipeline
        self._route_of = route_of  # session id -> the route whose input stages transcribe
        self._rate = sample_rate
        self._track = track  # the orchestrator awaits dropped tasks at shutdown
        self._by_session: dict[str, list[_Transcription]] = {}
        #: each session's last committed turn (audio, transcript): the next turn's ASR
        #: context (engine.messages.AsrRequest.context_audio)
        self._last: dict[str, tuple[bytes, str]] = {}
        self._ids = itertools.count()
        self.started = 0
        self.skipped = 0  # pauses not guessed: another session's turn was running
        self.used = 0

    def _start(self, fence: Fence, audio: bytes, kind: Literal["pause", "turn"]) -> _Transcription:
        sid = fence.session_id
        rid = f"{sid}/asr/t{fence.turn_id}/{next(self._ids)}"
        task = asyncio.create_task(
            self._pipeline.transcribe(
                rid,
                audio,
                route=self._route_of(sid),
                sample_rate=self._rate,
                session_id=sid,
                context=self._last.get(sid),
                # a guess only uses the stage when no committed turn waits for it
                priority=Priority.SPECULATIVE if kind == "pause" else Priority.REALTIME,
            ),
            name=f"asr:{rid}",
        )
        entry = _Transcription(kind, audio, task)
        entries = self._by_session.setdefault(sid, [])
        entries.append(entry)
        for old in [e for e in entries if not e.claimed][: max(0, len(entries) - _PER_SESSION)]:
            entries.remove(old)
            self._discard(old)
        return entry

    def _discard(self, entry: _Transcription) -> None:
        if not entry.task.done():
            entry.task.cancel()
        self._track(entry.task)

    def start(self, fence: Fence, audio: bytes) -> asyncio.Task[str]:
        """``input.pause``: transcribe the input so far (replaces an older pause guess)."""
        self.resume(fence.session_id)
        entry = self._start(fence, audio, "pause")
        self.started += 1
        return entry.task

    def skip(self, session_id: str) -> None:
        """``input.pause`` that is not guessed (the orchestrator's call): an older guess of
        the session now misses words, so it goes too."""
        self.resume(session_id)
        self.skipped += 1

    def resume(self, session_id: str) -> None:
        """``input.resume``: the user goes on, so a pause guess would miss words."""
        entries = self._by_session.get(session_id, [])
        for entry in [e for e in entries if e.kind == "pause" and not e.claimed]:
            entries.remove(entry)
            self._discard(entry)

    @property
    def nbytes(self) -> int:
        """Audio held by the transcriptions kept (at most ``_PER_SESSION`` unclaimed each)."""
        return sum(len(e.audio) for entries in self._by_session.values() for e in entries)

    def drop(self, session_id: str) -> None:
        """The session is closing: stop everything."""
        self._last.pop(session_id, None)
        for entry in self._by_session.pop(session_id, []):
            self._discard(entry)

    async def transcript(self, fence: Fence, audio: bytes) -> str:
        """The transcript of a committed turn's audio.

        Reuses a transcription that covers it (a pause guess, or the same turn's ASR started
        before a barge-in cancelled its job); else starts one. The ASR task is shielded: a
        cancelled job leaves it running for the job that re-queues the same words.
        """
        sid = fence.session_id
        entries = self._by_session.setdefault(sid, [])
        entry = next((e for e in reversed(entries) if e.covers(audio)), None)
        if entry is not None and entry.kind == "pause":
            self.used += 1
        if entry is None:
            entry = self._start(fence, audio, "turn")
        entry.claimed = True
        try:
            text = await asyncio.shield(entry.task)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                entry.claimed = False  # this job was cancelled; its re-queued twin takes over
                raise
            # the transcription itself was cancelled (a close raced it): transcribe again
            if entry in entries:
                entries.remove(entry)
            return await self.transcript(fence, audio)
        except StageError:
            if entry in entries:
                entries.remove(entry)
            if entry.kind == "turn":
                raise
            log.info("speculative ASR failed for %s; transcribing again", sid)
            return await self.transcript(fence, audio)
        if entry in entries:
            entries.remove(entry)
        if text.strip():
            self._last[sid] = (audio, text)
        return text

    def tasks(self) -> list[asyncio.Task[str]]:
        return [e.task for entries in self._by_session.values() for e in entries]
