"""What the engine's session store keeps of a session, and the session rebuilt from it after
an engine restart (pure: no I/O, no clock; engine/duplex/store.py writes and reads them).

A session is kept in two parts, written at different moments:

* :class:`ControlRecord`: what the control calls left: settings, fence (epoch and the turn
  and response counters), lease generation, the input buffer and the newest client input
  seq, the operation-id cache, the front end's replica, the played marks.
  Written before the answer of every call that changes them goes out (the answer then says
  ``saved``), never for an append (the front end keeps its appends until a later answer
  says ``saved``, and sends them again to a restarted engine).
* :class:`ConversationRecord`: the history and the committed turns not yet answered, also
  written as the turns progress (the user's words heard, a response finished).
* the item records (engine/duplex/item_book.py), each written on its own as an
  :class:`~duplex_contract.control.ItemsCall` changes it.

:func:`rebuild` makes the session of a kept one: detached (its grace period counts from
the restart, so nothing is reaped for the outage), its age kept; the answer that was
running is gone (its assistant turn ends ``cancelled``, cut to what the client reported it
played; its fence is returned, for the front end to end that response), and every committed
turn whose words are not in the history yet is queued again as it was (it is heard, and
answered if it asked for an answer).
"""

from __future__ import annotations

import msgspec

from duplex_contract.control import ItemRecord
from duplex_contract.fence import Fence
from duplex_contract.settings import SessionSettings
from duplex_contract.tools import ToolOutput
from engine.duplex.item_book import ItemBook
from engine.duplex.lease import Lease
from engine.duplex.operations import CachedOp, OperationCache
from engine.duplex.session import DuplexSession, TurnJob
from engine.orchestration.history import ConversationHistory, TurnState


class ControlRecord(msgspec.Struct, frozen=True):
    session_id: str
    config: SessionSettings
    fence: Fence
    lease_generation: int
    age_s: float  # since the session opened (max_session_s counts on from it)
    last_seq: int | None
    replica: bytes
    audio: bytes
    audio_stream_ms: float | None
    text_items: list[tuple[str | None, str]]
    tool_outputs: list[ToolOutput]
    ops: list[tuple[str, CachedOp]]
    played: list[tuple[int, int, float]]
    open_op: str | None = None


class ConversationRecord(msgspec.Struct, frozen=True):
    history: list[TurnState]
    jobs: list[TurnJob]  # the running one first, then the queued ones


def control_record(session: DuplexSession, now: float) -> ControlRecord:
    return ControlRecord(
        session_id=session.session_id,
        config=session.config,
        fence=session.fence,
        lease_generation=session.lease.generation,
        age_s=max(0.0, now - session.lease.created_at),
        last_seq=session.last_seq,
        replica=session.replica,
        audio=bytes(session.audio),
        audio_stream_ms=session.audio_stream_ms,
        text_items=list(session.text_items),
        tool_outputs=list(session.tool_outputs),
        ops=session.ops.entries(),
        played=[(t, r, ms) for (t, r), ms in session.played.items()],
        open_op=session.open_op,
    )


def conversation_record(session: DuplexSession) -> ConversationRecord:
    jobs = ([session.active] if session.active is not None else []) + list(session.jobs)
    return ConversationRecord(history=session.history.snapshot(), jobs=jobs)


class KeptSession(msgspec.Struct, frozen=True):
    """One session as the store kept it: its two records, its item records (oldest first)
    and the front end's state of them."""

    control: ControlRecord
    conversation: ConversationRecord
    items: tuple[ItemRecord, ...] = ()
    items_state: bytes = b""


def rebuild(kept: KeptSession, budget_chars: int, now: float) -> tuple[DuplexSession, Fence | None]:
    """The session of a kept record and the fence of the answer that was running (None:
    none), as :mod:`this module <engine.duplex.records>` says."""
    control, conversation = kept.control, kept.conversation
    history = ConversationHistory.restore(budget_chars, conversation.history)
    played = {(t, r): ms for t, r, ms in control.played}
    for turn_id, response_seq in history.unfinished():  # the answer that was running
        mark = played.get((turn_id, response_seq))
        if mark is not None:
            history.truncate(turn_id, response_seq, mark)
        history.finish_assistant(turn_id, response_seq, "cancelled")
    lease = Lease(created_at=now - control.age_s, last_activity=now, detached_at=now)
    lease.generation = control.lease_generation
    session = DuplexSession(
        session_id=control.session_id,
        config=control.config,
        fence=control.fence,
        lease=lease,
        history=history,
        audio=bytearray(control.audio),
        audio_stream_ms=control.audio_stream_ms,
        text_parts=[t for _, t in control.text_items],
        text_items=list(control.text_items),
        tool_outputs=list(control.tool_outputs),
        last_seq=control.last_seq,
        replica=control.replica,
        items=ItemBook.restore(kept.items, kept.items_state),
        open_op=control.open_op,
        ops=OperationCache.restore(control.ops),
    )
    dropped = None
    for job in conversation.jobs:
        if job.heard:  # its words are in the history; its answer was running
            dropped = job.fence if job.respond else dropped
            continue
        session.jobs.append(job)
    return session, dropped
