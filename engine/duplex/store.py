"""The engine's session store: every open session, kept in a local SQLite file so that an
engine that restarts (``duplex-server engine --state PATH``; ``serve --workers`` passes one)
takes its sessions back (docs/scale.md, "Sessions outlive the engine").

A session is one row of ``sessions`` (its :class:`~engine.duplex.records.ControlRecord`, its
:class:`~engine.duplex.records.ConversationRecord`, msgpack, and the front end's state of its
items) and one row of ``items`` per conversation item (its record, written as an
``ItemsCall`` changes it, so a long conversation's items are not written again with every
call). All of it is written on the orchestrator thread (its only user) as the calls and
turns change it, and deleted when the session ends. The file is in WAL mode with
``synchronous=NORMAL``: a write is in the file once its statement returns, so a killed
engine process (``kill -9``, a crash, out of memory) loses nothing written; only a crash of
the whole machine may lose the last writes. A row that no longer decodes (a file of another
version) is skipped with a warning.
"""

from __future__ import annotations

import itertools
import logging
import sqlite3
from pathlib import Path

import msgspec

from duplex_contract.control import ItemRecord
from engine.duplex.effects import ItemChanges
from engine.duplex.records import (
    ControlRecord,
    ConversationRecord,
    KeptSession,
    control_record,
    conversation_record,
)
from engine.duplex.session import DuplexSession

log = logging.getLogger(__name__)

_ENCODER = msgspec.msgpack.Encoder()
_CONTROL = msgspec.msgpack.Decoder(ControlRecord)
_CONVERSATION = msgspec.msgpack.Decoder(ConversationRecord)
_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS sessions (id TEXT PRIMARY KEY, control BLOB NOT NULL, "
    "conversation BLOB NOT NULL, items_state BLOB NOT NULL DEFAULT x'')",
    # n: the order items were first added in (a record replaced keeps its place)
    "CREATE TABLE IF NOT EXISTS items (session TEXT NOT NULL, item_id TEXT NOT NULL, "
    "n INTEGER NOT NULL, record BLOB NOT NULL, PRIMARY KEY (session, item_id))",
)


class SessionStore:
    """The sessions of one engine in the SQLite file ``path`` (made if missing)."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self._db = sqlite3.connect(self.path, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        for statement in _SCHEMA:
            self._db.execute(statement)
        (last,) = self._db.execute("SELECT COALESCE(MAX(n), 0) FROM items").fetchone()
        self._n = itertools.count(int(last) + 1)
        self.writes = 0  # rows written (figures)

    def save(self, session: DuplexSession, now: float) -> None:
        """Keep the whole session as it is now (its item records are kept on their own)."""
        control = _ENCODER.encode(control_record(session, now))
        conversation = _ENCODER.encode(conversation_record(session))
        self._db.execute(
            "INSERT OR REPLACE INTO sessions (id, control, conversation, items_state) "
            "VALUES (?, ?, ?, ?)",
            (session.session_id, control, conversation, session.items.state),
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

    def save_items(self, changes: ItemChanges) -> None:
        """Keep what an ``ItemsCall`` changed, in one transaction."""
        sid = changes.session_id
        with self._db:
            self._db.execute("BEGIN")
            for rec in changes.upserts:
                self._db.execute(
                    "INSERT INTO items (session, item_id, n, record) VALUES (?, ?, ?, ?) "
                    "ON CONFLICT (session, item_id) DO UPDATE SET record = excluded.record",
                    (sid, rec.item_id, next(self._n), rec.record),
                )
            self._db.executemany(
                "DELETE FROM items WHERE session = ? AND item_id = ?",
                [(sid, item_id) for item_id in changes.gone],
            )
            if changes.state:
                self._db.execute(
                    "UPDATE sessions SET items_state = ? WHERE id = ?", (changes.state, sid)
                )
        self.writes += 1

    def forget(self, session_id: str) -> None:
        """The session ended: its rows go."""
        with self._db:
            self._db.execute("BEGIN")
            self._db.execute("DELETE FROM sessions WHERE id = ?", (session_id,))
            self._db.execute("DELETE FROM items WHERE session = ?", (session_id,))

    def load(self) -> list[KeptSession]:
        """Every kept session (a row that no longer decodes is skipped, with a warning)."""
        items: dict[str, list[ItemRecord]] = {}
        for sid, item_id, record in self._db.execute(
            "SELECT session, item_id, record FROM items ORDER BY n"
        ):
            items.setdefault(sid, []).append(ItemRecord(item_id, record))
        out: list[KeptSession] = []
        for sid, control, conversation, state in self._db.execute(
            "SELECT id, control, conversation, items_state FROM sessions"
        ):
            try:
                records = (_CONTROL.decode(control), _CONVERSATION.decode(conversation))
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.warning("session store %s: %s is unreadable (%s); skipped", self.path, sid, exc)
                continue
            out.append(KeptSession(*records, tuple(items.get(sid, ())), bytes(state)))
        return out

    def close(self) -> None:
        self._db.close()
