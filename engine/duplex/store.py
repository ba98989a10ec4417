"""The engine's session store: every open session, kept in a local SQLite file so that an
engine that restarts (``duplex-server engine --state PATH``; ``serve --workers`` passes one)
takes its sessions back (docs/scale.md, "Sessions outlive the engine").

One row per session: its :class:`~engine.duplex.records.ControlRecord` and its
:class:`~engine.duplex.records.ConversationRecord` (msgpack), written on the orchestrator
thread (its only user) as the calls and turns change them, deleted when the session ends.
The file is in WAL mode with ``synchronous=NORMAL``: a write is in the file once its
statement returns, so a killed engine process (``kill -9``, a crash, out of memory) loses
nothing written; only a crash of the whole machine may lose the last writes. A row that no
longer decodes (a file of another version) is skipped with a warning.
"""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

import msgspec

from engine.duplex.records import (
    ControlRecord,
    ConversationRecord,
    control_record,
    conversation_record,
)
from engine.duplex.session import DuplexSession

log = logging.getLogger(__name__)

_ENCODER = msgspec.msgpack.Encoder()
_CONTROL = msgspec.msgpack.Decoder(ControlRecord)
_CONVERSATION = msgspec.msgpack.Decoder(ConversationRecord)


class SessionStore:
    """The sessions of one engine in the SQLite file ``path`` (made if missing)."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self._db = sqlite3.connect(self.path, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS sessions ("
            "id TEXT PRIMARY KEY, control BLOB NOT NULL, conversation BLOB NOT NULL)"
        )
        self.writes = 0  # rows written (figures)

    def save(self, session: DuplexSession, now: float) -> None:
        """Keep the whole session as it is now."""
        control = _ENCODER.encode(control_record(session, now))
        conversation = _ENCODER.encode(conversation_record(session))
        self._db.execute(
            "INSERT OR REPLACE INTO sessions (id, control, conversation) VALUES (?, ?, ?)",
            (session.session_id, control, conversation),
        )
        self.writes += 1

    def save_conversation(self, session: DuplexSession) -> None:
        """Keep the session's history and turns (its control part as last saved)."""
        conversation = _ENCODER.encode(conversation_record(session))
        self._db.execute(
            "UPDATE sessions SET conversation = ? WHERE id = ?",
            (conversation, session.session_id),
        )
        self.writes += 1

    def forget(self, session_id: str) -> None:
        """The session ended: its row goes."""
        self._db.execute("DELETE FROM sessions WHERE id = ?", (session_id,))

    def load(self) -> list[tuple[ControlRecord, ConversationRecord]]:
        """Every kept session (a row that no longer decodes is skipped, with a warning)."""
        out: list[tuple[ControlRecord, ConversationRecord]] = []
        for sid, control, conversation in self._db.execute(
            "SELECT id, control, conversation FROM sessions"
        ):
            try:
                out.append((_CONTROL.decode(control), _CONVERSATION.decode(conversation)))
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.warning("session store %s: %s is unreadable (%s); skipped", self.path, sid, exc)
        return out

    def close(self) -> None:
        self._db.close()
