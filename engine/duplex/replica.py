"""Front-end state kept in the engine, so any front end can take a session over: its
replica and its conversation items.

The front end that owns a session keeps a small opaque blob of its protocol state in the
engine (:class:`~duplex_contract.control.ReplicaCall`; duplex_server/session/snapshot.py says
what is in it and when it is sent), and the records of its conversation items
(:class:`~duplex_contract.control.ItemsCall`, engine/duplex/item_book.py). A front end asked
to resume a session it does not know first *peeks* (``ResumeCall(peek=True)``): it gets the
current lease generation, the blob, the item records and the newest client input seq the
engine has, checks the client's resume token against the blob, and then resumes with that
generation (the usual compare and swap: of two front ends racing, one wins). The engine
never reads the blob or the records. Pure functions of the control plane's session
table, called by :class:`~engine.duplex.control_plane.DuplexControl` and its
:class:`~engine.duplex.lifecycle.Lifecycle` (on the orchestrator thread).
"""

from __future__ import annotations

import msgspec

from duplex_contract.control import ControlResult, ItemsCall, ReplicaCall
from duplex_contract.errors import ControlError
from engine.duplex.effects import ItemChanges
from engine.duplex.fencing import check_lease
from engine.duplex.session import DuplexSession
from engine.duplex.table import SessionTable

#: a replica over this is refused (it is the protocol state, not the conversation)
MAX_REPLICA_BYTES = 64 * 1024


def keep(table: SessionTable, call: ReplicaCall, control_id: int) -> ControlResult:
    """Store the owner's latest replica; a replaced owner's (older lease) is refused."""
    session = table.lookup(call.fence.session_id)
    check_lease(call.lease_generation, session.lease.generation)
    if len(call.state) > MAX_REPLICA_BYTES:
        raise ControlError(
            f"replica of {len(call.state)} bytes is over {MAX_REPLICA_BYTES}",
            code="invalid_argument",
        )
    session.replica = call.state
    return session.ok(control_id)


def items(
    table: SessionTable, call: ItemsCall, control_id: int
) -> tuple[ControlResult, ItemChanges]:
    """The owner's item records changed (engine/duplex/item_book.py); a replaced owner's
    (older lease) are refused. Also returns what the session store must keep of it."""
    session = table.lookup(call.fence.session_id)
    check_lease(call.lease_generation, session.lease.generation)
    evicted = session.items.apply(call.upserts, call.deletes, call.state)
    changes = ItemChanges(session.session_id, call.upserts, (*call.deletes, *evicted), call.state)
    return session.ok(control_id), changes


def peek(session: DuplexSession, control_id: int) -> ControlResult:
    """What a front end needs to take the session over; changes nothing."""
    res = session.ok(control_id, replica=session.replica, input_seq=session.last_seq)
    return msgspec.structs.replace(
        res, items=session.items.records(), items_state=session.items.state
    )
