"""The interruption decision (pure): what the user's speech over an answer does to it.

One rule for every route: the WebSocket, WebRTC, Twilio, and any other wire on this session
core (a server-paced wire such as GPT-Live yields to the user by this same decision).
:func:`decide` takes the session's :class:`Rule` (from ``turn_detection``) and the
:class:`Speech` heard so far and returns a :data:`Verdict`; the barge-in bookkeeping
(:mod:`~duplex_server.protocol.barge_in`) feeds it the evidence as it comes and carries the
verdicts out. :func:`~duplex_server.protocol.input.should_interrupt` is this rule in
``immediate`` mode.

Modes (``turn_detection.interrupt_mode``):

* ``immediate`` (OpenAI's behaviour): speech that lasts ``min_interrupt_speech_ms`` stops the
  answer (not within ``uninterruptible_ms`` of its start), and a cut is final.
* ``confirm``: the answer **pauses** at the speech onset (the user hears it stop at once:
  the VAD's first window of voice, one before the speech is confirmed; an onset that is
  lost before, :class:`~duplex_server.protocol.vad_events.VadOnsetLost`, takes the pause
  back), then the speech is judged. It **stops** the answer (as ``immediate`` would) when it says a
  word that is not a backchannel by the time it falls quiet, or when its voice lasts to
  ``confirm_window_ms`` from its onset. It **resumes** the answer from where it paused when
  it falls quiet (the VAD's pause inside speech, ~64-96 ms of silence) sooner, having said
  nothing but backchannels ("mm-hm", "yeah", "okay", "right": ``backchannels``) or no word
  at all (a cough, a laugh, a door, a breath), or less than ``min_interrupt_speech_ms``.
  Words that come after the wait, while the speech's turn is still open, still stop it;
  voice that comes back pauses it again.
* ``auto`` (the default): ``confirm`` where the server plays the answer (its far end reports
  playout: WebRTC, Twilio, a server-paced wire), ``immediate`` on a WebSocket, whose client
  plays the audio and opts in to ``confirm`` (it then pauses and resumes its player on
  ``output_audio_buffer.paused`` / ``.resumed``).

The evidence and its path. The VAD (the input lane, off the loop) gives the onset, the
pauses and the end; ``speech_ms`` counts its voice (the pauses left out). The words: when
the speech falls quiet while it is judged, its audio so far is transcribed by the engine's ASR stage
(Whisper on the CPU default, ~0.15-0.3 s for a short speech there; a batch job of the
session runtime) and the verdict waits up to ``words_wait_ms`` (:data:`WORDS_WAIT_MS`) for
them. The live partials (pocketsphinx, a bounded number of streams) come too late and too
wrong for this (measured: first words 0.4-1.4 s after the onset on a loaded machine, and
"you", "if", "the" for "wait", "try again", "yeah"; "and i'm a champ" for "mm-hm"): they are
shown to the client, not judged. Budget: the pause at the onset (the VAD's first window
of voice, 32 ms before it confirms the speech), the verdict when the speech falls quiet
(its length, ~100 ms of silence, then its words: ~0.2-0.6 s) or at ``confirm_window_ms``.
Speech whose words do not come in time (a loaded ASR stage) is judged on the acoustic
evidence alone: short speech that falls quiet is taken back, long speech stops the
answer, so a lone short "wait" is then taken back too.

How words are read (:func:`heard`): hyphens as spaces, then lower-cased; a phrase of the
backchannel list counts as a backchannel; single letters, words in capitals (Whisper spells
a hum it cannot make a word of: "M.M.H.N.", "MMACM") and the few function words a
recogniser guesses for a hum (:data:`FILLERS`) count as nothing; anything else is a word.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, replace
from typing import Literal

from duplex_server.protocol.events import TurnDetection

Mode = Literal["immediate", "confirm"]
#: ``pause``: the answer pauses (confirm, at the onset); ``stop``: it is interrupted;
#: ``resume``: a pause is taken back; ``go_on``: nothing changes now
Verdict = Literal["go_on", "pause", "stop", "resume"]
#: heard -> paused -> stopped, or -> taken_back (-> paused again if the voice comes back)
State = Literal["heard", "paused", "taken_back", "stopped"]

#: what a listener says that never interrupts (``turn_detection.backchannels`` replaces it)
DEFAULT_BACKCHANNELS: tuple[str, ...] = (
    "mm-hm", "mm-hmm", "mhm", "mm", "hmm", "hm", "uh-huh", "uh huh", "huh", "um", "uh",
    "ah", "aha", "oh", "ooh", "wow", "yeah", "yes", "yep", "yup", "ya", "yah", "okay", "ok",
    "right", "alright", "all right", "sure", "i see", "got it", "cool", "nice", "great",
    "true", "exactly", "indeed", "totally", "of course", "good",
)  # fmt: skip
#: words that alone never interrupt: what a recogniser makes of a hum or a breath
#: ("mm-hm" came out of pocketsphinx as "the", "and i'm a", "it you"; of Whisper as
#: "M M them")
FILLERS = frozenset(
    "the an and i'm you it to of in is he she we they them are am be that this its it's was "
    "which with on at by for or".split()
)

_WORD = re.compile(r"[a-z']+")
_CASED = re.compile(r"[A-Za-z']+")
#: a speech that fell quiet waits this long for its transcript (the engine's ASR on its
#: audio so far, ~0.15-0.3 s on the CPU default); then it is judged on acoustics alone
WORDS_WAIT_MS = 600.0


def words_of(text: str) -> tuple[str, ...]:
    """``text``'s words: lower-cased, hyphens as spaces, punctuation dropped."""
    return tuple(_WORD.findall(text.lower().replace("-", " ")))


@functools.lru_cache(maxsize=64)
def lexicon(phrases: tuple[str, ...] | None) -> frozenset[tuple[str, ...]]:
    """The backchannel phrases (None: :data:`DEFAULT_BACKCHANNELS`) as word tuples."""
    return frozenset(w for w in map(words_of, phrases or DEFAULT_BACKCHANNELS) if w)


def heard(
    text: str, backchannels: frozenset[tuple[str, ...]]
) -> Literal["none", "backchannel", "words"]:
    """What a transcript says: ``none`` (no word), ``backchannel`` (backchannels only) or
    ``words`` (at least one other word)."""
    # capitals are letters Whisper heard and could not make a word of ("M.M.H.N.", "MMACM"
    # for a hum): spelled-out sound, as single letters are
    cased = _CASED.findall(text.replace("-", " "))
    toks = tuple(
        "" if len(t) > 1 and t.isupper() and (t.lower(),) not in backchannels else t.lower()
        for t in cased
    )
    longest = max((len(p) for p in backchannels), default=1)
    said = False
    i = 0
    while i < len(toks):
        for n in range(min(longest, len(toks) - i), 0, -1):
            if toks[i : i + n] in backchannels:
                i += n
                said = True
                break
        else:
            if len(toks[i]) > 1 and toks[i] not in FILLERS:
                return "words"
            i += 1  # a letter or capitals (a hum spelled out), or a filler
    return "backchannel" if said else "none"


@dataclass(frozen=True, slots=True)
class Rule:
    """One session's interruption settings, resolved (``turn_detection``)."""

    mode: Mode
    min_speech_ms: float
    uninterruptible_ms: float
    confirm_ms: float
    backchannels: frozenset[tuple[str, ...]]
    #: how long a quiet speech waits for its words before it is judged without them
    words_wait_ms: float = WORDS_WAIT_MS

    @staticmethod
    def of(td: TurnDetection | None, *, server_playout: bool) -> Rule | None:
        """The rule of ``td`` (None: speech never interrupts); ``server_playout``: the
        server plays the answer (``auto`` is then ``confirm``)."""
        if td is None or not td.interrupt_response:
            return None
        mode: Mode
        if td.interrupt_mode == "auto":
            mode = "confirm" if server_playout else "immediate"
        else:
            mode = td.interrupt_mode
        return Rule(
            mode,
            float(td.min_interrupt_speech_ms),
            float(td.uninterruptible_ms),
            float(td.confirm_window_ms),
            lexicon(td.backchannels),
        )

    def immediate(self) -> Rule:
        return replace(self, mode="immediate")

    def window_open(self, started_ms: float | None, now_ms: float) -> bool:
        """Is the answer that started at ``started_ms`` past its uninterruptible window?"""
        return started_ms is None or now_ms - started_ms >= self.uninterruptible_ms


@dataclass(slots=True)
class Speech:
    """What is known of one stretch of the user's speech over an answer."""

    #: its voice so far (while it lasts: the VAD's pauses inside it left out; at its end:
    #: its length from the onset)
    speech_ms: float = 0.0
    quiet: bool = False  # the VAD hears a pause in it, or it ended
    words: str = ""  # its transcript, once known
    state: State = "heard"
    #: when its words were asked for (None: not asked, or they came)
    asked_ms: float | None = None


def decide(rule: Rule, speech: Speech, *, window_open: bool, now_ms: float = 0.0) -> Verdict:
    """The one rule: what ``speech`` does to the answer now (``window_open``: the answer
    is past its uninterruptible window; ``now_ms``: the session's clock, for the wait for
    the speech's words)."""
    if speech.state == "stopped" or not window_open:
        return "go_on"
    if rule.mode == "immediate":
        return "stop" if speech.speech_ms >= rule.min_speech_ms else "go_on"
    if speech.state == "heard":  # (heard inside the uninterruptible window until now)
        return "go_on" if speech.quiet else "pause"
    said = heard(speech.words, rule.backchannels) == "words"
    said = said and speech.speech_ms >= rule.min_speech_ms
    if speech.state == "taken_back":  # the answer goes on again; the speech's turn is open
        if not speech.quiet:
            return "pause"  # the voice came back
        return "stop" if said else "go_on"  # words heard late still stop it
    if not speech.quiet:  # (quiet, it waits for its words: that is not speech)
        return "stop" if speech.speech_ms >= rule.confirm_ms else "go_on"
    if said:
        return "stop"
    asked = speech.asked_ms
    if asked is not None and speech.speech_ms >= rule.min_speech_ms:
        if now_ms - asked < rule.words_wait_ms:
            return "go_on"  # its words are on their way
    return "resume"
