"""A session's conversation items as its owning front end keeps them, held in the engine
beside the conversation (docs/scale.md, "What a crash keeps").

The front end numbers the items and builds their records (item ids, the wire item that
``conversation.item.retrieve`` returns, the engine turn of an assistant item and the audio
sent of it: what ``truncate`` and ``delete`` need); it sends each change
(:class:`~duplex_contract.control.ItemsCall`) and the engine keeps the latest record of each
item, in the order they were first added, with the front end's conversation state (the next
item number, the last item, the usage counters). A front end that takes the session over
(a crash of its owner) or an engine restarted from its store hands them back, so every
earlier item id still works. The engine reads neither; pure state, no I/O.
"""

from __future__ import annotations

from collections import OrderedDict

from duplex_contract.control import ItemRecord

#: items kept per session (the front end's own bound: the oldest are forgotten)
MAX_ITEMS = 256


class ItemBook:
    """The records of one session's items, oldest first, and the front end's state of them."""

    def __init__(self) -> None:
        self._records: OrderedDict[str, bytes] = OrderedDict()
        self.state = b""

    def apply(
        self, upserts: tuple[ItemRecord, ...], deletes: tuple[str, ...], state: bytes
    ) -> tuple[str, ...]:
        """One :class:`~duplex_contract.control.ItemsCall`: records replaced or added, dropped,
        and the state replaced when one is given. Returns the ids forgotten past the bound
        (the oldest)."""
        for rec in upserts:
            self._records[rec.item_id] = rec.record  # a known id keeps its place
        for item_id in deletes:
            self._records.pop(item_id, None)
        evicted: list[str] = []
        while len(self._records) > MAX_ITEMS:
            evicted.append(self._records.popitem(last=False)[0])
        if state:
            self.state = state
        return tuple(evicted)

    def forget(self, item_id: str) -> None:
        self._records.pop(item_id, None)

    def records(self) -> tuple[ItemRecord, ...]:
        return tuple(ItemRecord(i, r) for i, r in self._records.items())

    @classmethod
    def restore(cls, records: tuple[ItemRecord, ...], state: bytes) -> ItemBook:
        book = cls()
        book.apply(records, (), state)
        return book

    def __len__(self) -> int:
        return len(self._records)

    @property
    def nbytes(self) -> int:
        return len(self.state) + sum(len(r) for r in self._records.values())
