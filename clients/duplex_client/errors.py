"""The SDK's errors: what a connection, a session or a resume can fail with.

ConnectionError
├── ConnectionLost   the connection dropped and could not be resumed
└── SessionRefused   the server refused the session (auth, capacity) before it began
Exception
└── SessionEnded     ``next_event`` after the stream ended (closed, expired, replaced)
"""

from __future__ import annotations


class ConnectionLost(ConnectionError):
    """The connection dropped and could not be resumed."""


class SessionEnded(Exception):
    """``next_event`` after the stream ended (session closed, expired, replaced)."""


class SessionRefused(ConnectionError):
    """The server refused the session (auth, capacity) before ``session.created``.
    ``code``: the server's error code (``unauthorized``, ``resource_exhausted``,
    ``engine_unavailable``...) when it sent one."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code
