"""The operation-id cache of one session: a call retried with the same ``operation_id``
(a front end that lost the answer) gets the first answer again, ``deduplicated``, and
changes nothing; the same id on a different call is refused. The newest ``cap`` operations
are kept; a new epoch forgets them all. The engine's session store keeps them
(:meth:`OperationCache.entries`), so a call retried across an engine restart acts once."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import msgspec

from duplex_contract.control import ControlCall, ControlResult
from duplex_contract.errors import ControlError

_ENCODER = msgspec.msgpack.Encoder()


@dataclass(frozen=True)
class CachedOp:
    kind: str  # the call's type name
    digest: str  # of the whole call (digest_of)
    result: ControlResult


class OperationCache:
    """The last answers of a session's calls, by ``operation_id``."""

    def __init__(self) -> None:
        self._ops: OrderedDict[str, CachedOp] = OrderedDict()

    def replay(self, op_id: str, digest: str, control_id: int) -> ControlResult | None:
        """The answer ``op_id`` got before (now ``deduplicated``), or None if it is new.
        Raises ``invalid_argument`` if the id was used for a different call."""
        cached = self._ops.get(op_id)
        if cached is None:
            return None
        if cached.digest != digest:
            raise ControlError(
                f"operation_id {op_id} was used for a different call", code="invalid_argument"
            )
        return msgspec.structs.replace(cached.result, control_id=control_id, deduplicated=True)

    def remember(self, op_id: str, kind: str, digest: str, result: ControlResult, cap: int) -> None:
        """Keep ``result`` as the answer of ``op_id``; the oldest go past ``cap``."""
        self._ops[op_id] = CachedOp(kind, digest, result)
        self._ops.move_to_end(op_id)
        while len(self._ops) > cap:
            self._ops.popitem(last=False)

    def clear(self) -> None:
        self._ops.clear()

    def entries(self) -> list[tuple[str, CachedOp]]:
        """The cached answers, oldest first (the session store keeps them)."""
        return list(self._ops.items())

    @classmethod
    def restore(cls, entries: list[tuple[str, CachedOp]]) -> OperationCache:
        cache = cls()
        cache._ops.update(entries)
        return cache

    def __len__(self) -> int:
        return len(self._ops)


def call_digest(call: ControlCall) -> str:
    """The digest of a whole call (a retry must repeat it exactly)."""
    return digest_of(type(call).__name__, _ENCODER.encode(call))


def digest_of(*parts: object) -> str:
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        h.update(part if isinstance(part, bytes) else repr(part).encode())
        h.update(b"\x00")
    return h.hexdigest()
