"""User transcriptions that outlive the turn job that asked for them.

* Speculative ASR: the server signals ``input.pause`` once a short silence starts inside
  speech, and the transcript of the input so far is usually ready when the silence window
  ends the turn. A commit uses it when its audio starts with the speculated audio and the
  VAD heard no speech since (``input.resume`` drops the guess; ``Transcription.covers``).
  A pause that was not guessed (``skip``) bounds the turn the same way: the commit
  transcribes the audio up to it, so the words do not depend on whether a guess ran. A
  guess runs at ``Priority.SPECULATIVE``: behind every committed turn's ASR, so that on a
  loaded ASR stage the guesses (up to one per pause in the user's speech) never delay a
  turn; a queued guess that the user's next words make stale is aborted before it runs.
* Turn ASR survives a barge-in: a cancel aborts the old epoch's LLM and TTS work, but the
  user's words are re-queued in the new epoch (engine/duplex/epochs.py), and their
  transcription, already running, is picked up by the re-queued job (same audio) instead of
  starting again. So ASR request ids carry the session and turn but not the epoch
  (``sess_x/asr/t5/3``); a close still aborts them (session prefix).

* Context: each turn is transcribed after the same session's previous turn (its audio and
  transcript ride on the ASR request, with the silence between the two), so a short turn
  cut by the VAD ("Ever failed.") is decoded with the words around it, as the batch route
  decodes one whole recording. The ASR uses it only across a short gap (Whisper:
  ``context_max_gap_s``), and never once the assistant's answer to that turn has completed
  (``answered``): after a long silence or an answer the user starts a new utterance, and
  the previous words would leak into it (or swallow it: "it was the age of foolish" right
  after "... it was the age of foolishness." came out empty, then cost a second decode).
  The context must not depend on timing: a transcription waits for the previous turn's
  transcript when that is still running (a slow or busy ASR stage), and the gap is measured
  on the session's input clock (``AppendCall.stream_ms``: the audio the front end processed,
  silence included), not on the wall clock, which a stalled microphone stream or a slow
  machine stretches. Only a front end that sends no ``stream_ms`` falls back to the wall
  clock.

Runs on the orchestrator loop; the ASR itself runs in its stage.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from audio_kit.pcm import quiet_after, quiet_level
from duplex_contract.errors import StageError
from duplex_contract.fence import Fence
from engine.messages import Priority
from engine.pipeline.pipeline import Pipeline
from engine.tasks import cancelling

log = logging.getLogger(__name__)
_PER_SESSION = 4
#: Quiet after sound that followed a pause guess before the guess is made again (the same
#: wait as the front end's first guess, SPECULATE_AFTER_MS).
REGUESS_QUIET_MS = 96.0


#: The longest a transcription waits for the previous turn's words (its context). A turn
#: whose job is dropped unrun resolves at once (``abandon``); this bounds only the unforeseen.
CONTEXT_WAIT_S = 10.0


@dataclass(eq=False)
class CommittedTurn:
    """A committed turn with audio, from its commit on: the next turn's ASR context once
    its words are known (``words``, resolved when the turn's job has its transcript)."""

    audio: bytes
    stream_ms: float | None  # where ``audio`` starts on the session's input clock
    at: float  # when it was committed (monotonic clock): the fallback for the gap
    words: asyncio.Future[str]
    #: the assistant's answer to it was complete before the session spoke again: what the
    #: session says next is a new utterance, never decoded after this one
    answered: bool = False

    def seconds(self, rate: int) -> float:
        return len(self.audio) / (2 * rate)

    def resolve(self, text: str) -> None:
        if not self.words.done():
            self.words.set_result(text)

    async def text(self) -> str:
        """Its transcript ("" if it failed or was dropped); waits for it if need be."""
        try:
            return await asyncio.wait_for(asyncio.shield(self.words), CONTEXT_WAIT_S)
        except (TimeoutError, asyncio.CancelledError):
            if cancelling():
                raise
            return ""


@dataclass(eq=False)
class Transcription:
    """One transcription of a session's audio: a pause's guess or a turn's own."""

    kind: Literal["pause", "turn"]
    audio: bytes
    task: asyncio.Task[str]
    claimed: bool = False  # a turn job awaits it: never discarded under that job
    respond: bool = True  # the pause asked for a draft answer too
    stream_ms: float | None = None  # where ``audio`` starts on the session's input clock
    after: CommittedTurn | None = None  # the committed turn it is decoded after (its context)
    _level: float | None = None  # quiet_level(audio), computed once

    def sound_since(self, audio: bytes | bytearray, rate: int) -> bool | None:
        """A pause guess and the turn's audio now (``audio`` starts with the guess's):
        True when sound the VAD did not call speech (a soft last syllable, a breath)
        followed the guessed point and has ended (the last ``REGUESS_QUIET_MS`` are
        quiet), so the guess misses it and a new one can start; False when the guess still
        covers the audio or the sound goes on; None when ``audio`` is not this turn's."""
        if not audio.startswith(self.audio):
            return None
        if self._level is None:
            self._level = quiet_level(self.audio)
        if quiet_after(audio, len(self.audio), self._level):
            return False
        quiet = 2 * int(rate * REGUESS_QUIET_MS / 1000)
        if len(audio) - len(self.audio) <= quiet:
            return False
        return quiet_after(audio, len(audio) - quiet, self._level)

    def covers(self, audio: bytes) -> bool:
        """Does this transcription serve a commit of ``audio``? A turn's own: the same
        audio. A pause guess: the turn's audio starts with the guess's, and nothing the VAD
        called speech came after it, which the guess's survival says (``input.resume``
        drops it). What followed was not speech to the VAD (a breath, room noise, a reverb
        tail) and is not judged by its energy: in a recorded room it is rarely below
        ``quiet_after``'s level, so guesses were almost never used (beckett.wav's tails
        reach -10 dB of its speech). Sound that ends before the commit is still
        transcribed: ``sound_since`` makes the guess again to include it."""
        if self.kind == "pause":
            return audio.startswith(self.audio)
        return audio == self.audio


class SpeculativeAsr:
    def __init__(
        self,
        pipeline: Pipeline,
        sample_rate: int,
        track: Callable[[asyncio.Task[Any]], None],
        route_of: Callable[[str], str],
        language_of: Callable[[str], str],
        stream_of: Callable[[str], float | None] = lambda sid: None,
    ) -> None:
        self._pipeline = pipeline
        self._route_of = route_of  # session id -> the route whose input stages transcribe
        self._language_of = language_of  # session id -> its transcription language
        #: session id -> where its uncommitted audio starts on its input clock
        self._stream_of = stream_of
        self._rate = sample_rate
        self._track = track  # the orchestrator awaits dropped tasks at shutdown
        self._by_session: dict[str, list[Transcription]] = {}
        #: each session's committed turns with audio, in commit order: the last whose
        #: words are known and those still in transcription (the next turn's ASR context,
        #: AsrRequest.context_audio, is the turn before it)
        self._turns: dict[str, list[CommittedTurn]] = {}
        #: session id -> its audio at the last pause the VAD heard no speech after (guessed
        #: or not): a commit transcribes that much, the same audio a guess would have
        self._paused: dict[str, bytes] = {}
        self._ids = itertools.count()
        self.started = 0
        self.skipped = 0  # pauses not guessed: another session's turn was running
        self.reguesses = 0  # guesses made again: sound the VAD missed followed the pause
        self.used = 0

    def _gap_s(self, last: CommittedTurn, audio: bytes, stream_ms: float | None) -> float:
        """The silence between the last committed turn and ``audio``: on the input clock
        when both positions are known (and in order: a resumed session's new front end
        starts its clock again), else by the wall clock (the audio arrives in real time:
        it began len(audio) ago)."""
        if stream_ms is not None and last.stream_ms is not None and stream_ms >= last.stream_ms:
            return max(0.0, (stream_ms - last.stream_ms) / 1000.0 - last.seconds(self._rate))
        return max(0.0, time.monotonic() - len(audio) / (2 * self._rate) - last.at)

    async def _transcribe(
        self,
        rid: str,
        sid: str,
        audio: bytes,
        last: CommittedTurn | None,
        gap: float,
        priority: Priority,
    ) -> str:
        context: tuple[bytes, str] | None = None
        if last is not None and not last.answered:
            text = await last.text()  # the previous turn's words, however slow they are
            context = (last.audio, text) if text.strip() else None
        return await self._pipeline.transcribe(
            rid,
            audio,
            route=self._route_of(sid),
            sample_rate=self._rate,
            session_id=sid,
            language=self._language_of(sid),
            context=context,
            context_gap_s=gap,
            priority=priority,
        )

    def _start(
        self,
        fence: Fence,
        audio: bytes,
        kind: Literal["pause", "turn"],
        stream_ms: float | None,
        speech: bytes | None = None,
    ) -> Transcription:
        """Transcribe ``audio`` (a turn's: only its ``speech``, the audio up to its last
        pause, when given)."""
        sid = fence.session_id
        rid = f"{sid}/asr/t{fence.turn_id}/{next(self._ids)}"
        last = self._before(sid, audio if kind == "turn" else None)
        heard = audio if speech is None else speech
        gap = 0.0 if last is None else self._gap_s(last, heard, stream_ms)
        # a guess only uses the stage when no committed turn waits for it
        priority = Priority.SPECULATIVE if kind == "pause" else Priority.REALTIME
        task = asyncio.create_task(
            self._transcribe(rid, sid, heard, last, gap, priority), name=f"asr:{rid}"
        )
        entry = Transcription(kind, audio, task, stream_ms=stream_ms, after=last)
        entries = self._by_session.setdefault(sid, [])
        entries.append(entry)
        for old in [e for e in entries if not e.claimed][: max(0, len(entries) - _PER_SESSION)]:
            entries.remove(old)
            self._discard(old)
        return entry

    def committed(self, session_id: str, audio: bytes, stream_ms: float | None) -> None:
        """A turn with audio was committed: it is the context of whatever the session says
        next, even before its own transcript is done."""
        if not audio:
            return
        words: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        turn = CommittedTurn(audio, stream_ms, time.monotonic(), words)
        self._turns.setdefault(session_id, []).append(turn)

    def answered(self, session_id: str) -> None:
        """A response to the session's latest committed turn completed: the session's next
        words answer it, and are transcribed without that turn as context, however soon
        they come (a client that speaks right after the answer's last event)."""
        turns = self._turns.get(session_id)
        if turns:
            turns[-1].answered = True

    def abandon(self, session_id: str) -> None:
        """The session's committed turns not transcribed yet were dropped (its input was
        cancelled): a turn waiting for their words goes without them."""
        for turn in self._turns.get(session_id, []):
            turn.resolve("")

    def _record(self, sid: str, audio: bytes) -> CommittedTurn | None:
        return next((t for t in self._turns.get(sid, []) if t.audio is audio), None)

    def _before(self, sid: str, audio: bytes | None) -> CommittedTurn | None:
        """The committed turn before ``audio``'s turn (None: before uncommitted audio)."""
        turns = self._turns.get(sid)
        if not turns:
            return None
        if audio is not None:
            for i, turn in enumerate(turns):
                if turn.audio is audio:  # the job's own audio object
                    return turns[i - 1] if i else None
        return turns[-1]

    def _heard(self, sid: str, audio: bytes, text: str) -> None:
        """A committed turn's transcript is known: resolve it, and forget the turns before
        it (nothing transcribes before it any more)."""
        turns = self._turns.get(sid, [])
        for i, turn in enumerate(turns):
            if turn.audio is audio:
                turn.resolve(text)
                if text.strip():
                    del turns[:i]
                else:  # no words: the turn before stays the context
                    del turns[i]
                    del turns[: max(0, i - 1)]
                return

    def _discard(self, entry: Transcription) -> None:
        if not entry.task.done():
            entry.task.cancel()
        self._track(entry.task)

    def start(
        self, fence: Fence, audio: bytes, respond: bool = True, again: bool = False
    ) -> asyncio.Task[str]:
        """``input.pause``: transcribe the input so far (replaces an older pause guess).
        ``again``: a guess made again after sound followed the pause (``stale_guess``); the
        older guess is left to finish, unused by a commit, since a draft answer may be
        waiting on its words (the same words as the new guess's, most often)."""
        if again:
            entries = self._by_session.get(fence.session_id, [])
            for old in [e for e in entries if e.kind == "pause" and not e.claimed]:
                entries.remove(old)
                self._track(old.task)
        else:
            self.resume(fence.session_id)
        self._paused[fence.session_id] = audio
        entry = self._start(fence, audio, "pause", self._stream_of(fence.session_id))
        entry.respond = respond
        self.started += 1
        return entry.task

    def stale_guess(self, session_id: str, audio: bytes | bytearray) -> bool | None:
        """More input arrived: should the pause's guess be made again for ``audio`` (sound
        followed it and has ended, see ``Transcription.sound_since``)? Returns the guess's
        ``respond`` flag if so, None if not (no guess, or it still covers the audio)."""
        entries = self._by_session.get(session_id)
        if not entries:
            return None
        last = entries[-1]
        if last.kind != "pause" or last.claimed:
            return None
        if last.sound_since(audio, self._rate):
            self.reguesses += 1
            return last.respond
        return None

    def skip(self, session_id: str, audio: bytes | None = None) -> None:
        """``input.pause`` that is not guessed (the orchestrator's call): an older guess of
        the session now misses words, so it goes too. ``audio``: the session's audio at the
        pause; a commit with no speech since transcribes that much, as a guess would have
        (so whether a guess ran, which depends on the load, does not change the words)."""
        self.resume(session_id)
        if audio is not None:
            self._paused[session_id] = audio
        self.skipped += 1

    def resume(self, session_id: str) -> None:
        """``input.resume``: the user goes on, so a pause guess would miss words."""
        self._paused.pop(session_id, None)
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
        self._paused.pop(session_id, None)
        for turn in self._turns.pop(session_id, []):
            if not turn.words.done():
                turn.words.cancel()
        for entry in self._by_session.pop(session_id, []):
            self._discard(entry)

    async def transcript(self, fence: Fence, audio: bytes, stream_ms: float | None = None) -> str:
        """The transcript of a committed turn's audio (``stream_ms``: where it starts on
        the session's input clock, if known).

        Reuses a transcription that covers it (a pause guess, or the same turn's ASR started
        before a barge-in cancelled its job); else starts one. The ASR task is shielded: a
        cancelled job leaves it running for the job that re-queues the same words. From
        now on this turn is the context of the session's next one.
        """
        sid = fence.session_id
        entries = self._by_session.setdefault(sid, [])
        mine = self._record(sid, audio)
        entry = next(
            # (never one that waits for this turn's own words: the same sound said again)
            (
                e
                for e in reversed(entries)
                if e.covers(audio) and (mine is None or e.after is not mine)
            ),
            None,
        )
        if entry is not None and entry.kind == "pause":
            self.used += 1
        paused = self._paused.pop(sid, None)
        if entry is None:
            # the VAD heard no speech after the turn's last pause (``covers``): its words
            # are in the audio up to there, the audio a guess transcribes
            speech = paused if paused is not None and audio.startswith(paused) else None
            entry = self._start(fence, audio, "turn", stream_ms, speech)
        entry.claimed = True
        try:
            text = await asyncio.shield(entry.task)
        except asyncio.CancelledError:
            if cancelling():
                entry.claimed = False  # this job was cancelled; its re-queued twin takes over
                raise
            # the transcription itself was cancelled (a close raced it): transcribe again
            if entry in entries:
                entries.remove(entry)
            return await self.transcript(fence, audio, stream_ms)
        except StageError:
            if entry in entries:
                entries.remove(entry)
            if entry.kind == "turn":
                self._heard(sid, audio, "")
                raise
            log.info("speculative ASR failed for %s; transcribing again", sid)
            self._paused[sid] = entry.audio  # the same audio, now as the turn's
            return await self.transcript(fence, audio, stream_ms)
        if entry in entries:
            entries.remove(entry)
        self._heard(sid, audio, text)
        return text

    def tasks(self) -> list[asyncio.Task[str]]:
        return [e.task for entries in self._by_session.values() for e in entries]
