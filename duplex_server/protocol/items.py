"""Conversation items (pure): ids, the item chain (``previous_item_id``), what can be
retrieved, which user item an engine turn belongs to, and the assistant audio items a
playback ack or truncate may refer to.

:class:`Conversation` builds the item events; it makes no decision about turns or
responses (the session core calls it when they happen). It also notes which items changed
since it was last asked (:meth:`Conversation.take_changes`: each one's :class:`ItemState`),
so the session runtime can keep them in the engine beside the conversation, and a front end
that takes the session over starts from them (:meth:`Conversation.restore`, docs/scale.md).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Any

import msgspec

from duplex_server.protocol import events as ev
from duplex_server.protocol.commands import Action, Send
from duplex_server.protocol.errors import ProtocolError

_MAX_ITEMS = 256


def user_text(item: ev.ItemParam) -> str:
    """The text of a user item a client creates; refuses anything else."""
    if item.role != "user":
        raise ProtocolError("unsupported", "only user items can be created", param="item.role")
    texts: list[str] = []
    for i, part in enumerate(item.content):
        if part.type not in ("input_text", "text") or not isinstance(part.text, str):
            raise ProtocolError(
                "unsupported",
                "user items carry input_text content (send audio with input_audio_buffer)",
                param=f"item.content.{i}.type",
            )
        texts.append(part.text)
    text = " ".join(t for t in texts if t.strip())
    if not text:
        raise ProtocolError("invalid_value", "the item has no text", param="item.content")
    return text


class ItemState(msgspec.Struct, frozen=True):
    """What a conversation keeps of one item: the item (None: an assistant item whose
    response has not finished), its engine turn (an assistant item) and the audio sent of
    it (an assistant audio item: turn, response, ms)."""

    item_id: str
    item: ev.AnyItem | None = None
    turn: tuple[int, int] | None = None
    audio: tuple[int, int, float] | None = None


class Conversation:
    """The items of one session, newest last (bounded: the oldest are forgotten)."""

    def __init__(self, session_id: str) -> None:
        self._tag = session_id[5:17]
        self._n = 0
        self.last_item: str | None = None
        self._changed: dict[str, None] = {}  # item ids changed since take_changes, in order
        self._deleted: dict[str, None] = {}
        self._items: OrderedDict[str, ev.AnyItem] = OrderedDict()
        #: assistant items (messages and calls): (turn_id, response_seq) in the engine
        self._turns: OrderedDict[str, tuple[int, int]] = OrderedDict()
        #: function calls the model made: call_id -> function name
        self.calls: OrderedDict[str, str] = OrderedDict()
        #: assistant audio items: (turn_id, response_seq, audio sent in ms)
        self._assistant: OrderedDict[str, tuple[int, int, float]] = OrderedDict()
        self._pending: deque[str] = deque()  # committed audio items, commit unanswered
        self._by_turn: OrderedDict[int, str] = OrderedDict()

    # ------------------------------------------------------------------ ids and the chain
    def new_id(self, kind: str) -> str:
        self._n += 1
        return f"{kind}_{self._tag}{self._n:05d}"

    @property
    def numbered(self) -> int:
        """Ids given so far (the next one continues after it)."""
        return self._n

    def link(self, item_id: str) -> str | None:
        """Make ``item_id`` the newest item; returns the one before it."""
        previous = self.last_item
        self.last_item = item_id
        return previous

    def remember(self, item: ev.AnyItem) -> None:
        self._touch(item.id)
        self._items[item.id] = item
        _bound(self._items)
        if isinstance(item, ev.FunctionCallItem) and item.status == "completed":
            self.calls[item.call_id] = item.name
            _bound(self.calls)

    def get(self, item_id: str) -> ev.AnyItem | None:
        return self._items.get(item_id)

    def assistant_turn(self, item_id: str, turn_id: int, response_seq: int) -> None:
        self._touch(item_id)
        self._turns[item_id] = (turn_id, response_seq)
        _bound(self._turns)

    def turn_of(self, item_id: str) -> tuple[int, int] | None:
        """The engine turn of an assistant item (None: a user or tool item)."""
        return self._turns.get(item_id)

    def forget(self, item_id: str) -> None:
        """``item_id`` was deleted."""
        self._changed.pop(item_id, None)
        self._deleted[item_id] = None
        self._items.pop(item_id, None)
        self._turns.pop(item_id, None)
        self._assistant.pop(item_id, None)
        if self.last_item == item_id:
            self.last_item = next(reversed(self._items), None)

    def tool_output(self, item_id: str | None, call_id: str, output: str) -> list[Action]:
        """A ``function_call_output`` item the client created."""
        item_id = item_id if item_id is not None else self.new_id("item")
        previous = self.link(item_id)
        item = ev.FunctionCallOutputItem(id=item_id, call_id=call_id, output=output)
        self.remember(item)
        return [
            Send(ev.ItemAdded(item=item, previous_item_id=previous)),
            Send(ev.ItemDone(item=item, previous_item_id=previous)),
        ]

    # ------------------------------------------------------------------ user items
    def user_audio(self, item_id: str) -> list[Action]:
        """A user audio turn was committed as ``item_id`` (its transcript follows)."""
        previous = self.link(item_id)
        self._pending.append(item_id)
        item = ev.Item(
            id=item_id,
            role="user",
            content=[ev.ContentPart(type="input_audio", transcript=None)],
            status="in_progress",
        )
        self.remember(item)
        return [
            Send(ev.InputCommitted(item_id=item_id, previous_item_id=previous)),
            Send(ev.ItemAdded(item=item, previous_item_id=previous)),
        ]

    def user_text(self, item_id: str, text: str) -> list[Action]:
        previous = self.link(item_id)
        item = ev.Item(
            id=item_id, role="user", content=[ev.ContentPart(type="input_text", text=text)]
        )
        self.remember(item)
        return [
            Send(ev.ItemAdded(item=item, previous_item_id=previous)),
            Send(ev.ItemDone(item=item, previous_item_id=previous)),
        ]

    def commit_accepted(self, item_id: str, turn_id: int) -> None:
        """The engine numbered the turn of ``item_id``."""
        if self._pending and self._pending[0] == item_id:
            self._pending.popleft()
        self._by_turn[turn_id] = item_id
        _bound(self._by_turn)

    def commit_failed(self, item_id: str) -> None:
        if item_id in self._pending:
            self._pending.remove(item_id)

    def transcript(self, turn_id: int, text: str, final: bool) -> list[Action]:
        """A transcript of the user turn ``turn_id``."""
        item_id = self._by_turn.get(turn_id)
        if item_id is None and self._pending:
            # the transcript overtook its commit's reply: jobs run in commit order, so it
            # belongs to the oldest commit still unanswered
            item_id = self._pending.popleft()
            self._by_turn[turn_id] = item_id
        if item_id is None:
            return []
        if not final:
            return [Send(ev.InputTranscriptDelta(item_id=item_id, delta=text))]
        del self._by_turn[turn_id]
        item = ev.Item(
            id=item_id,
            role="user",
            content=[ev.ContentPart(type="input_audio", transcript=text)],
        )
        self.remember(item)
        return [
            Send(ev.InputTranscriptDelta(item_id=item_id, delta=text)),
            Send(ev.InputTranscriptCompleted(item_id=item_id, transcript=text)),
            Send(ev.ItemDone(item=item)),
        ]

    # ------------------------------------------------------------------ assistant audio
    def assistant_audio(
        self, item_id: str, turn_id: int, response_seq: int, sent_ms: float
    ) -> None:
        """Record (or update) what was sent of an assistant audio item."""
        self._touch(item_id)
        self._assistant[item_id] = (turn_id, response_seq, sent_ms)
        _bound(self._assistant)

    def assistant_record(self, item_id: str) -> tuple[int, int, float] | None:
        """``(turn_id, response_seq, audio sent in ms)`` of an assistant audio item."""
        return self._assistant.get(item_id)

    # ------------------------------------------------------------------ kept in the engine
    def _touch(self, item_id: str) -> None:
        self._changed[item_id] = None
        self._deleted.pop(item_id, None)

    @property
    def changed(self) -> bool:
        """Items changed (or were deleted) since :meth:`take_changes`."""
        return bool(self._changed or self._deleted)

    def state_of(self, item_id: str) -> ItemState | None:
        """What is kept of ``item_id`` (None: nothing, e.g. forgotten past the bound)."""
        item, turn = self._items.get(item_id), self._turns.get(item_id)
        audio = self._assistant.get(item_id)
        if item is None and turn is None and audio is None:
            return None
        return ItemState(item_id, item, turn, audio)

    def take_changes(self) -> tuple[list[ItemState], list[str]]:
        """The items changed since the last call, and the ids deleted; forgets both."""
        changed = [st for i in self._changed if (st := self.state_of(i)) is not None]
        deleted = list(self._deleted)
        self._changed.clear()
        self._deleted.clear()
        return changed, deleted

    def restore(self, states: list[ItemState], numbered: int, last_item: str | None) -> None:
        """Start from the kept items of a session taken over (oldest first). An item whose
        response was running when its front end was lost is ``incomplete``."""
        self._n = max(self._n, numbered)
        for st in states:
            item = st.item
            if isinstance(item, ev.Item) and item.status == "in_progress":
                item = msgspec.structs.replace(item, status="incomplete")
            if item is not None:
                self.remember(item)
            if st.turn is not None:
                self.assistant_turn(st.item_id, *st.turn)
            if st.audio is not None:
                self.assistant_audio(st.item_id, *st.audio)
        self.last_item = last_item
        self._changed.clear()


def _bound(d: OrderedDict[Any, Any]) -> None:
    while len(d) > _MAX_ITEMS:
        d.popitem(last=False)
