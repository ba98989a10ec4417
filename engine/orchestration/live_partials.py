"""Live partial transcripts on the orchestrator's loop: the audio a session is heard to
speak goes to the partial transcriber (engine/orchestration/partials.py, pocketsphinx in a
child process), and its text comes back as non-final ``UserTranscript`` events.

Each session's input has a generation, raised when its uncommitted input is committed or
cleared: text of an older generation arrives late and is dropped, never shown as the new
input's."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Protocol

from duplex_contract.languages import ENGLISH_ONLY
from duplex_contract.session_events import SessionEvent, UserTranscript
from engine.duplex.effects import Effects
from engine.duplex.session import DuplexSession

#: (session id, generation, text): called from the transcriber's receiver thread
OnPartial = Callable[[str, int, str], None]


class PartialFeed(Protocol):
    """A streaming transcriber (engine/orchestration/partials.py ``PartialTranscriber``)."""

    def feed(self, session_id: str, generation: int, pcm: bytes) -> None: ...

    def reset(self, session_id: str) -> None: ...

    def drop(self, session_id: str) -> None: ...

    def close(self) -> None: ...


class LivePartials:
    """``open_feed(on_partial)`` starts the transcriber; ``emit(sid, event)`` routes an
    event; ``language_of(sid)`` is the session's transcription language (pocketsphinx's
    model is en-us: other languages get no partials)."""

    def __init__(
        self,
        open_feed: Callable[[OnPartial], PartialFeed],
        loop: asyncio.AbstractEventLoop,
        sessions: Mapping[str, DuplexSession],
        emit: Callable[[str, SessionEvent], None],
        language_of: Callable[[str], str],
    ) -> None:
        self._loop = loop
        self._sessions = sessions
        self._emit = emit
        self._language_of = language_of
        self._generation: dict[str, int] = {}
        self._feed = open_feed(self._from_worker)

    def on_effects(self, effects: Effects) -> None:
        """New input (a commit or a clear) starts a new generation; heard audio is fed."""
        for sid in effects.input_reset:
            self._generation[sid] = self._generation.get(sid, 0) + 1
            self._feed.reset(sid)
        for sid, pcm in effects.heard:
            if self._language_of(sid) in ENGLISH_ONLY:
                self._feed.feed(sid, self._generation.get(sid, 0), pcm)

    def drop(self, sid: str) -> None:
        """The session is closed: its stream and generation go."""
        self._feed.drop(sid)
        self._generation.pop(sid, None)

    def close(self) -> None:
        """Stop the transcriber (blocks: call it off the loop)."""
        self._feed.close()

    def _from_worker(self, sid: str, generation: int, text: str) -> None:
        try:
            self._loop.call_soon_threadsafe(self._partial, sid, generation, text)
        except RuntimeError:
            pass  # shutting down

    def _partial(self, sid: str, generation: int, text: str) -> None:
        if self._generation.get(sid, 0) != generation:
            return  # a partial of input that was already committed or cleared
        session = self._sessions.get(sid)
        if session is not None and session.state == "open":
            self._emit(sid, UserTranscript(fence=session.fence, text=text, final=False))
