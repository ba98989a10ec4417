"""Conversation items kept in the engine (pure): the core notes each item that changed and
each one deleted; a core taken over on another front end starts from the kept records and
serves every earlier item id (retrieve, truncate, delete), numbers new ids after the old
ones, and goes on with the usage counters. An engine restart ends an answer that was
running (``session.resync_required{engine_restarted}``, then ``response.done{cancelled}``);
an answer asked for and not started is left to the restarted engine, and an idle session
never notices."""

from __future__ import annotations

import json

import msgspec

from duplex_contract.control import ItemRecord
from duplex_contract.fence import Fence
from duplex_contract.session_events import (
    AudioChunk,
    ResponseDone,
    ResponseStarted,
    SessionLifecycle,
)
from duplex_server.protocol import events as ev
from duplex_server.protocol.codec import decode_client_event
from duplex_server.protocol.commands import (
    Action,
    Call,
    Cancel,
    DeleteItem,
    RecordItems,
    Resync,
    Send,
    Touch,
)
from duplex_server.protocol.machine import SessionMachine
from duplex_server.protocol.session_config import EffectiveSession
from duplex_server.session.snapshot import item_changes, restore_items

SID = "sess_w1_0123456789abcdef0123456789abcdef"


def _client(core: SessionMachine, **event: object) -> list[Action]:
    return core.on_client_event(decode_client_event(json.dumps(event)), 0.0)


def _sent(actions: list[Action]) -> list[ev.ServerEvent]:
    return [a.event for a in actions if isinstance(a, Send)]


def _answered_turn(core: SessionMachine, text: str, turn: int) -> str:
    """A text item and a spoken answer to it; returns the answer's item id."""
    _client(
        core,
        type="conversation.item.create",
        item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]},
    )
    _client(core, type="response.create")
    fence = Fence(SID, 0, turn, turn)
    out = core.on_engine_event(ResponseStarted(fence=fence), 0.0)
    added = [e for e in _sent(out) if isinstance(e, ev.ResponseCreated)]
    assert added
    pcm = b"\0\0" * 2400  # 100 ms at 24 kHz
    out = core.on_engine_event(AudioChunk(fence, pcm, 24000, 0.0, 100.0, text="Hi."), 0.0)
    out += core.on_engine_event(ResponseDone(fence=fence, status="completed"), 0.0)
    done = [e for e in _sent(out) if isinstance(e, ev.ResponseDone)]
    return done[0].response.output[0].id


def _keep(core: SessionMachine, book: dict[str, bytes]) -> bytes:
    """What the engine's ItemBook keeps of the core's changes; returns the state."""
    call = item_changes(core)
    assert isinstance(call, RecordItems)
    for rec in call.upserts:
        book[rec.item_id] = rec.record
    for item_id in call.deletes:
        book.pop(item_id, None)
    return call.state


def test_a_core_taken_over_serves_every_earlier_item_id() -> None:
    old = SessionMachine(SID, EffectiveSession())
    book: dict[str, bytes] = {}
    first_answer = _answered_turn(old, "alpha", 1)
    assert old.items.changed
    _keep(old, book)
    assert not old.items.changed
    _answered_turn(old, "bravo", 2)
    state = _keep(old, book)
    user_ids = [i for i in book if isinstance(old.items.get(i), ev.Item) and i != first_answer]
    assert len(book) == 4  # two user items, two answers

    new = SessionMachine(SID, EffectiveSession())  # another front end, after a crash
    restore_items(new, tuple(ItemRecord(i, r) for i, r in book.items()), state)
    for item_id in book:  # retrieve
        (got,) = _sent(_client(new, type="conversation.item.retrieve", item_id=item_id))
        assert isinstance(got, ev.ItemRetrieved) and got.item == old.items.get(item_id)
    # truncate an earlier answer by its id: the engine is told its turn
    out = _client(
        new, type="conversation.item.truncate", item_id=first_answer, content_index=0,
        audio_end_ms=50,
    )  # fmt: skip
    (touch,) = [a.command for a in out if isinstance(a, Call)]
    assert isinstance(touch, Touch) and touch.playback is not None
    assert (touch.playback.turn_id, touch.playback.response_seq) == (1, 1)
    assert isinstance(_sent(out)[0], ev.ItemTruncated)
    # delete an earlier user item by its id; the engine is told, and so is the book
    out = _client(new, type="conversation.item.delete", item_id=user_ids[0])
    assert [type(a.command) for a in out if isinstance(a, Call)] == [DeleteItem]
    assert _keep(new, book) and user_ids[0] not in book
    # new ids go on after the old ones; the usage counters go on too
    assert new.items.new_id("item") not in book
    assert new.usage.total() == old.usage.total()
    assert new.items.last_item == old.items.last_item


def test_items_in_flight_at_a_crash_come_back_as_far_as_they_got() -> None:
    old = SessionMachine(SID, EffectiveSession())
    book: dict[str, bytes] = {}
    old.items.user_audio("item_audio1")  # committed, its transcript not in yet
    _client(old, type="response.create")
    old.on_engine_event(ResponseStarted(fence=Fence(SID, 0, 1, 1)), 0.0)
    pcm = b"\0\0" * 2400
    old.on_engine_event(AudioChunk(Fence(SID, 0, 1, 1), pcm, 24000, 0.0, 100.0, "Hi"), 0.0)
    state = _keep(old, book)
    new = SessionMachine(SID, EffectiveSession())
    restore_items(new, tuple(ItemRecord(i, r) for i, r in book.items()), state)
    user, answer = book
    item = new.items.get(user)
    assert isinstance(item, ev.Item) and item.status == "incomplete"
    assert new.items.assistant_record(answer) == (1, 1, 0.0)  # a truncate of it works


def test_an_engine_restart_ends_a_running_answer_and_an_idle_session_never_notices() -> None:
    restored = SessionLifecycle(session_id=SID, state="restored", reason="engine_restarted")
    idle = SessionMachine(SID, EffectiveSession())
    assert idle.on_engine_event(restored, 0.0) == []
    assert idle.epoch == 0 and not idle.closed

    busy = SessionMachine(SID, EffectiveSession())
    _client(busy, type="response.create")
    busy.on_engine_event(ResponseStarted(fence=Fence(SID, 0, 1, 1)), 0.0)
    out = busy.on_engine_event(restored, 0.0)
    assert out[0] == Resync("engine_restarted")
    done = [e for e in _sent(out) if isinstance(e, ev.ResponseDone)]
    assert done[0].response.status == "cancelled"
    assert done[0].response.status_details is not None
    assert done[0].response.status_details.reason == "engine_restarted"
    cancels = [a.command for a in out if isinstance(a, Call) and isinstance(a.command, Cancel)]
    assert cancels and busy.epoch == 1 and not busy.responses.active and not busy.closed
    # an answer asked for and not started is the restarted engine's to give: nothing yet
    asked = SessionMachine(SID, EffectiveSession())
    _client(asked, type="response.create")
    assert asked.on_engine_event(restored, 0.0) == [] and asked.responses.active
    # ... unless it is the one that was dropped (its start never arrived): started, ended
    lost = msgspec.structs.replace(restored, dropped=Fence(SID, 0, 1, 1))
    out = asked.on_engine_event(lost, 0.0)
    sent = _sent(out)
    assert out[0] == Resync("engine_restarted")
    assert isinstance(sent[0], ev.ResponseCreated)
    (done,) = [e for e in sent if isinstance(e, ev.ResponseDone)]
    assert done.response.status == "cancelled"
    assert not asked.responses.active
