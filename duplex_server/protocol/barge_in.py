"""Barge-in (sans-I/O): the user's speech over an answer, judged by the one rule
(:mod:`~duplex_server.protocol.interruption`), and what each verdict does.

:class:`BargeIn` is told what the input side hears of one stretch of speech (its onset,
its length, the VAD's pauses inside it and its end, its live transcript) and returns the
actions the verdicts call for:

* ``immediate`` mode: the response tracker's barge-in (``min_interrupt_speech_ms``,
  ``uninterruptible_ms``; talk-over of audio a far end still plays after its response
  ended), as it always was;
* ``confirm`` mode, while an answer is audible (audio of the response in progress was
  emitted, or an item still plays at the far end, or a WebSocket client is believed to
  play it: :meth:`Playout.audible`): **pause** (``output_audio_buffer.paused``; the playout
  holds the item's audio: :meth:`Playout.pause`), then **stop** (a cancel of the response in
  progress as in ``immediate`` mode: epoch bump, ``response.done{cancelled}``,
  ``output_audio_buffer.cleared``; or, if its response had ended, a clear of its audio:
  the item is truncated to what was heard before the pause) or **resume**
  (``output_audio_buffer.resumed`` and, where the server plays the audio, the item again
  from its last played position). The fence and epoch do not change before a stop, and the
  engine goes on producing the answer meanwhile.

The words. When the speech falls quiet (the VAD's pause inside it) while it is being judged,
its audio so far is transcribed (:class:`TranscribeSpeech`: the runtime runs the engine's ASR
stage on it, the words come back to :meth:`BargeIn.words`); the rule waits up to
``words_wait_ms`` for them. Whisper hears a short "wait" or "no, stop" as such, where the
live partials (pocketsphinx) guessed "you" or "if" for them and "and i'm a champ" for an
"mm-hm" (docs/protocol.md §6.1): the partials are shown to the client, the decision reads
this transcript. A session whose words do not come in time is judged on its acoustics.

A speech that ends taken back on its acoustics while its words are on their way (a loaded
ASR stage) waits for them, up to ``SETTLE_MS`` (client_input.py): words that are not
backchannels then stop the answer after all and the speech becomes the turn it was; else it
is dropped. So a slow transcription costs a resumed answer cut late, never the user's words.

A speech taken back never becomes a turn: at its end the session does not commit it and
the engine drops its audio (``input.discard``), so a listener's "mm-hm" is not answered
and history is untouched. While a speech is being judged, its pauses are not transcribed
ahead (no ``input.pause``): a guess and a draft answer to "mm-hm" would be wasted work.
With nothing audible (the response pending, its audio not yet started) the ``immediate``
rule applies: speech then is the user going on, not talking over an answer.
"""

from __future__ import annotations

from typing import Literal

from duplex_server.protocol import events as ev
from duplex_server.protocol.commands import Action, Send, TranscribeSpeech
from duplex_server.protocol.interruption import Rule, Speech, Verdict, decide
from duplex_server.protocol.playout import Playout
from duplex_server.protocol.response_tracker import ResponseTracker

#: what becomes of a speech judged over an answer when it ends
Fate = Literal["commit", "discard", "settle"]

#: the audio of one speech kept for its words: 4 s at 16 kHz (a speech that long is judged
#: by its length, not its words)
MAX_AUDIO_BYTES = 4 * 32000


class BargeIn:
    """One session's speech over its answers: the rule's evidence and its verdicts."""

    def __init__(self, responses: ResponseTracker, playout: Playout) -> None:
        self.responses = responses
        self.playout = playout
        self.speech: Speech | None = None  # the speech being judged (confirm mode)
        #: (response id, item id) of the answer it is judged against
        self.target: tuple[str, str] | None = None
        self.number = 0  # of the speech judged (its words come back with it)
        self._audio = bytearray()  # its audio so far (engine input rate)
        self._last_ms = 0.0  # its length (from the onset) when last told
        #: a speech that ended taken back while its words were on their way
        self.settling: Speech | None = None
        #: verdicts so far (for tests and metrics): pause, stop, resume
        self.counts = {"pause": 0, "stop": 0, "resume": 0}
        #: (response id, item id) of an answer paused on an onset not yet speech
        self.tentative: tuple[str, str] | None = None

    @property
    def holding(self) -> bool:
        """Is a speech over the answer being judged, or was it taken back? (Its pauses
        are then not transcribed ahead.)"""
        return self.speech is not None and self.speech.state in ("paused", "taken_back")

    def rule(self, td: ev.TurnDetection | None) -> Rule | None:
        return Rule.of(td, server_playout=self.playout.far_end)

    # ------------------------------------------------------------------ evidence
    def candidate(self, td: ev.TurnDetection | None, now_ms: float) -> list[Action]:
        """An onset heard (one VAD window of voice), not yet speech: in ``confirm`` the
        audible answer pauses now, one window sooner than at the speech's start (which
        keeps it paused, :meth:`onset`); an onset that falls silent first takes the pause
        back (:meth:`lost`)."""
        rule = self.rule(td)
        if rule is None or rule.mode == "immediate" or self.tentative is not None:
            return []
        target = self._audible(now_ms)
        if target is None or not rule.window_open(self._started(target[0]), now_ms):
            return []
        if self.playout.is_paused(target[1]):
            return []  # (already held)
        self.tentative = target
        self.counts["pause"] += 1
        self.playout.pause(target[1], now_ms)
        return [Send(ev.OutputAudioPaused(response_id=target[0], item_id=target[1]))]

    def lost(self, now_ms: float) -> list[Action]:
        """The onset fell silent before it was speech (or hovered ``ONSET_HOLD_MS``
        between the VAD's thresholds): a pause on it is taken back."""
        tentative, self.tentative = self.tentative, None
        if tentative is None or not self.playout.alive(tentative[1]):
            return []
        self.counts["resume"] += 1
        return self._resume(tentative[0], tentative[1], now_ms)

    def onset(self, td: ev.TurnDetection | None, now_ms: float) -> list[Action]:
        """Speech began (the VAD's onset)."""
        self.speech, self.target = None, None
        tentative, self.tentative = self.tentative, None
        rule = self.rule(td)
        target = None if rule is None or rule.mode == "immediate" else self._audible(now_ms)
        out: list[Action] = []
        held = tentative is not None and tentative == target
        if tentative is not None and not held:
            self.tentative = tentative
            out = self.lost(now_ms)  # (the rule or the answer changed meanwhile)
        if rule is None or target is None:
            return out  # nothing heard yet (or immediate): the immediate rule applies
        self.speech, self.target = Speech(state="paused" if held else "heard"), target
        self.number += 1
        self._audio = bytearray()
        self._last_ms = 0.0
        return out + self._judge(rule, now_ms)

    def audio(self, pcm: bytes) -> None:
        """Audio of the speech (what is appended to the engine for it), kept for its words."""
        if self.speech is not None and len(self._audio) < MAX_AUDIO_BYTES:
            self._audio += pcm

    def speaking(
        self, td: ev.TurnDetection | None, speech_ms: float, now_ms: float
    ) -> list[Action]:
        """The speech has lasted ``speech_ms`` from its onset. What is judged counts its
        voice only: the time since it was last told, unless the VAD heard a pause (a word,
        a pause, then a breath or the next syllable is not a long speech)."""
        speech, rule = self.speech, self.rule(td)
        if speech is None or rule is None:
            return self.responses.barge_in(td, speech_ms, now_ms)
        if not speech.quiet:
            speech.speech_ms += max(0.0, speech_ms - self._last_ms)
        self._last_ms = speech_ms
        return self._judge(rule, now_ms)

    def quiet(self, td: ev.TurnDetection | None, quiet: bool, now_ms: float) -> list[Action]:
        """The VAD hears a pause inside the speech (``quiet``: its words are asked for, its
        audio so far transcribed) or the voice back."""
        speech, rule = self.speech, self.rule(td)
        if speech is None or rule is None:
            return []
        speech.quiet = quiet
        ask = quiet and speech.state == "paused" and bool(self._audio)
        ask = ask and speech.speech_ms >= rule.min_speech_ms
        if ask:
            speech.asked_ms, speech.words = now_ms, ""
        out = self._judge(rule, now_ms)
        if ask and speech.state == "paused":  # still to be judged: by its words
            out.append(TranscribeSpeech(self.number, bytes(self._audio)))
        return out

    def words(
        self, td: ev.TurnDetection | None, number: int, text: str, now_ms: float
    ) -> list[Action]:
        """The transcript of speech ``number`` (late words of an older one are dropped)."""
        speech, rule = self.speech, self.rule(td)
        if speech is None or rule is None or number != self.number:
            return []
        speech.words, speech.asked_ms = text, None
        return self._judge(rule, now_ms)

    def ended(
        self, td: ev.TurnDetection | None, speech_ms: float, now_ms: float
    ) -> tuple[list[Action], Fate]:
        """The speech ended (``speech_ms`` long): the actions, and its fate as a turn:
        ``commit``, ``discard`` (it was taken back) or ``settle`` (taken back on its
        acoustics while its words were on their way: they decide, :meth:`settle`)."""
        speech, rule = self.speech, self.rule(td)
        self.speech = None
        self._audio = bytearray()
        if speech is None or rule is None:
            return self.responses.barge_in(td, speech_ms, now_ms), "commit"
        speech.speech_ms = speech_ms
        speech.quiet = True
        waiting = speech.asked_ms is not None
        speech.asked_ms = None  # its end: judged with what is known
        out = self._judge(rule, now_ms, speech)
        if speech.state != "taken_back":
            return out, "commit"
        if waiting:
            self.settling = speech
            return out, "settle"
        return out, "discard"

    def settle(
        self, td: ev.TurnDetection | None, number: int, text: str, now_ms: float
    ) -> tuple[list[Action], Fate] | None:
        """The words of a speech that ended while they were on their way (None: not that
        speech's): words stop the answer after all and the speech is a turn; none, or
        backchannels only, and it is dropped."""
        speech, rule = self.settling, self.rule(td)
        if speech is None or number != self.number:
            return None
        self.settling = None
        if rule is None:
            return [], "discard"
        speech.words = text
        out = self._judge(rule, now_ms, speech)
        return out, "commit" if speech.state == "stopped" else "discard"

    def unsettle(self) -> None:
        """Its words did not come in time (or another speech began): it stays dropped."""
        self.settling = None

    def forget(self) -> None:
        """The speech in progress is no longer judged (its turn was committed by hand, or
        the input cleared)."""
        self.speech, self.target = None, None
        self._audio = bytearray()

    # ------------------------------------------------------------------ verdicts
    def _judge(self, rule: Rule, now_ms: float, speech: Speech | None = None) -> list[Action]:
        speech = speech or self.speech
        target = self.target
        if speech is None or target is None:
            return []
        if speech.state in ("paused", "taken_back") and not self.playout.alive(target[1]):
            speech.state = "stopped"  # its answer was cancelled or flushed meanwhile
            return []
        started = self._started(target[0])
        window = rule.window_open(started, now_ms)
        verdict: Verdict = decide(rule, speech, window_open=window, now_ms=now_ms)
        if verdict == "go_on":
            return []
        self.counts[verdict] += 1
        rid, item_id = target
        if verdict == "pause":
            speech.state = "paused"
            self.playout.pause(item_id, now_ms)
            return [Send(ev.OutputAudioPaused(response_id=rid, item_id=item_id))]
        if verdict == "resume":
            speech.state = "taken_back"
            return self._resume(rid, item_id, now_ms)
        speech.state = "stopped"
        self.playout.release(item_id)
        if self.responses.active:
            return self.responses.cancel("barge_in", "turn_detected", None, now_ms)
        return self.playout.clear(rid)

    def _resume(self, rid: str, item_id: str, now_ms: float) -> list[Action]:
        """The paused answer plays on from its last played position."""
        position = self.playout.resume_position(item_id)
        audio = self.playout.resume(item_id, now_ms)
        at = audio[0].audio_start_ms if audio else position
        resumed = ev.OutputAudioResumed(response_id=rid, item_id=item_id, audio_start_ms=at)
        return [Send(resumed), *audio]

    def _started(self, response_id: str) -> float | None:
        """When ``response_id`` started (its uninterruptible window), if known."""
        current = self.responses.current
        if current is not None and current.id == response_id:
            return current.started_ms
        last = self.responses.lifecycle.last_started
        return last[1] if last is not None and last[0] == response_id else None

    def _audible(self, now_ms: float) -> tuple[str, str] | None:
        """The answer the user may be hearing: the response in progress once its audio
        began, else audio still playing (or paused) of one that ended."""
        current = self.responses.current
        if current is not None and current.audio and current.audio_ms > 0:
            return current.id, current.item_id
        return self.playout.audible(now_ms)
