"""What a front end keeps of a session in the engine, so any front end can take it over.

A session's protocol state lives in the front end that serves it (the session core, its
journal). What another front end needs to continue it after that process is gone is small:
the resume token's digest (to check the client), the session configuration (everything a
``session.update`` set) and how far the event numbering had gone. The owner sends it to the
engine as an opaque blob (:class:`Replica`, msgpack) whenever it changes: before the client
is given a new resume token (open, resume), after a configuration change, and once more when
the front end hands the session over on a drain. The engine keeps the latest one with the
session (engine/duplex/replica.py) and hands it to whichever front end resumes it next.

The conversation itself is the engine's (its history). The conversation items are kept
there too, beside it: each item that changed (:func:`item_changes`: its
:class:`~duplex_server.protocol.items.ItemState`, msgpack) and the front end's state of them
(:class:`ConversationHead`: the next item number, the last item, the usage counters), sent
after the core's actions changed them; a front end that takes the session over starts from
them (:func:`restore_items`). What is *not* kept (the event journal, a response in
progress) is what a crash can lose; the taking-over front end says so with
``session.resync_required`` (docs/scale.md).
"""

from __future__ import annotations

import dataclasses
import logging

import msgspec

from duplex_contract.control import ItemRecord
from duplex_server.protocol.commands import RecordItems
from duplex_server.protocol.items import ItemState
from duplex_server.protocol.machine import SessionMachine
from duplex_server.protocol.session_config import EffectiveSession
from duplex_server.protocol.usage import UsageState

log = logging.getLogger(__name__)

VERSION = 1


class Replica(msgspec.Struct, frozen=True):
    version: int
    token_hash: bytes
    config: EffectiveSession  # without ``voices`` (the taking-over front end's own)
    event_seq: int  # the highest server_event_seq stamped when this was made
    #: the owner handed the session over on a drain and sent nothing after ``event_seq``
    handed_over: bool = False
    #: the wire adapter's own state (a GPT-Live session's start: live_runtime.py); empty
    #: for a Realtime session
    wire: bytes = b""


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Replica)


def encode(
    core: SessionMachine, event_seq: int, *, handed_over: bool = False, wire: bytes = b""
) -> bytes:
    config = dataclasses.replace(core.config, voices=None)
    token_hash = core.resumption.token_hash
    return _ENCODER.encode(Replica(VERSION, token_hash, config, event_seq, handed_over, wire))


def decode(blob: bytes, template: EffectiveSession) -> Replica:
    """The replica, its config completed with this front end's ``voices`` and output rate
    (from ``template``). Raises ``msgspec.DecodeError`` / ``ValidationError`` on junk."""
    rep = _DECODER.decode(blob)
    if rep.version != VERSION:
        raise msgspec.ValidationError(f"replica version {rep.version} (expected {VERSION})")
    config = dataclasses.replace(
        rep.config, voices=template.voices, output_rate=template.output_rate
    )
    return msgspec.structs.replace(rep, config=config)


class ConversationHead(msgspec.Struct, frozen=True):
    """The front end's state of a session's items, kept in the engine with them."""

    numbered: int  # item ids given so far
    last_item: str | None
    usage: UsageState


_ITEM_DECODER = msgspec.msgpack.Decoder(ItemState)
_HEAD_DECODER = msgspec.msgpack.Decoder(ConversationHead)


def item_changes(core: SessionMachine) -> RecordItems:
    """The engine call that keeps the items changed since the last one (and the head)."""
    changed, deleted = core.items.take_changes()
    upserts = tuple(ItemRecord(st.item_id, _ENCODER.encode(st)) for st in changed)
    head = ConversationHead(core.items.numbered, core.items.last_item, core.usage.snapshot())
    return RecordItems(upserts, tuple(deleted), _ENCODER.encode(head))


def restore_items(core: SessionMachine, records: tuple[ItemRecord, ...], state: bytes) -> None:
    """A session taken over continues with the items (and usage) its engine kept; a record
    that no longer decodes is skipped with a warning."""
    states: list[ItemState] = []
    for rec in records:
        try:
            states.append(_ITEM_DECODER.decode(rec.record))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("%s: item %s is unreadable: %s", core.session_id, rec.item_id, exc)
    head = ConversationHead(0, None, UsageState())
    if state:
        try:
            head = _HEAD_DECODER.decode(state)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("%s: the items' state is unreadable: %s", core.session_id, exc)
    core.items.restore(states, head.numbered, head.last_item)
    core.usage.restore(head.usage)
