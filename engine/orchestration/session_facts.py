"""What the orchestration reads of a session's settings: its route, its transcription
language and where its uncommitted audio starts (the control plane's session table)."""

from __future__ import annotations

from collections.abc import Mapping

from duplex_contract.languages import DEFAULT_LANGUAGE
from engine.duplex.session import DuplexSession


class SessionFacts:
    """Read-only answers about the sessions of ``sessions`` (session id -> session); a
    session that is gone gets the defaults."""

    def __init__(self, sessions: Mapping[str, DuplexSession]) -> None:
        self._sessions = sessions

    def route_of(self, sid: str) -> str:
        """A session's route: ``voice`` when its output includes audio, else ``text``."""
        session = self._sessions.get(sid)
        if session is not None and "audio" not in session.config.output_modalities:
            return "text"
        return "voice"

    def stream_of(self, sid: str) -> float | None:
        """Where a session's uncommitted audio starts on its input clock, if known."""
        session = self._sessions.get(sid)
        return None if session is None else session.audio_stream_ms

    def language_of(self, sid: str) -> str:
        """The language a session's speech is transcribed in (``en`` unless it set one)."""
        session = self._sessions.get(sid)
        return DEFAULT_LANGUAGE if session is None else session.config.language
