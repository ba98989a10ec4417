"""A session's turn timeline (pure): the moments of the user turn being answered and the
silence since the last answer.

The input side marks when the user's speech ended (:meth:`TurnTimeline.speech_ended`) and
when its transcript was ready; the response side takes those moments when the answer starts
(:meth:`TurnTimeline.take_moments`, for ``response.done``'s timing) and says when the answer
and its audio end (:meth:`TurnTimeline.answer_ended`). The idle timeout counts the silence
from there (:meth:`TurnTimeline.idle_since`), once per silence. Times are the caller's
clock in milliseconds.
"""

from __future__ import annotations


class TurnTimeline:
    """The turn being answered and the silence after the last answer."""

    def __init__(self) -> None:
        #: moments (ms) of the turn being answered: ``last_voice``, ``speech_stopped``,
        #: ``transcript_ready``
        self.moments: dict[str, float] = {}
        self._idle_since: float | None = None  # None: not armed

    def speech_ended(self, last_voice_ms: float, now_ms: float) -> None:
        """The user's turn ended now; its last voiced audio arrived at ``last_voice_ms``."""
        self.moments = {"last_voice": last_voice_ms, "speech_stopped": now_ms}

    def transcript_ready(self, now_ms: float) -> None:
        self.moments.setdefault("transcript_ready", now_ms)

    def take_moments(self) -> dict[str, float]:
        """An answer starts: the moments of the turn it answers (and they are forgotten)."""
        moments, self.moments = self.moments, {}
        return moments

    def silence_broken(self) -> None:
        """The user speaks, or an answer starts: no idle timeout this silence."""
        self._idle_since = None

    def answer_ended(self, at_ms: float) -> None:
        """An answer and its audio end at ``at_ms``: the silence counts from there."""
        self._idle_since = at_ms

    def idle_since(self, now_ms: float, timeout_ms: float) -> float | None:
        """When the silence began if it has lasted ``timeout_ms`` by ``now_ms`` (the timeout
        fires: it is disarmed until the next answer), else None."""
        since = self._idle_since
        if since is None or now_ms - since < timeout_ms:
            return None
        self._idle_since = None
        return since
