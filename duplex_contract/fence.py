"""The session position a caller believes current."""

from __future__ import annotations

import re

import msgspec

#: a front end's route key (``serve --route-key``): session ids carry it
ROUTE_KEY = re.compile(r"^[a-z0-9]{1,16}$")


def route_key_of(session_id: str) -> str | None:
    """The route key a session id carries (``sess_<key>_<hex>``), if any."""
    parts = session_id.split("_")
    return parts[1] if len(parts) == 3 and ROUTE_KEY.match(parts[1]) else None


def resume_query(session_id: str) -> str:
    """The query string a client opens its resume socket with: a load balancer routes
    on ``route`` to the front end that owns the session (docs/scale.md)."""
    key = route_key_of(session_id)
    return "intent=resume" if key is None else f"intent=resume&route={key}"


class Fence(msgspec.Struct, frozen=True, forbid_unknown_fields=True, order=True):
    """Immutable; ordered by ``(epoch, turn_id, response_seq)`` within a session."""

    session_id: str
    epoch: int = 0
    turn_id: int = 0
    response_seq: int = 0

    def key(self) -> str:
        """Prefix of every stage request id of this fence: ``sess_x/e3/t5/r1``."""
        return f"{self.session_id}/e{self.epoch}/t{self.turn_id}/r{self.response_seq}"

    def is_stale_against(self, current: Fence) -> bool:
        """True when this fence is older than ``current``."""
        if self.session_id != current.session_id:
            return True
        if self.epoch != current.epoch:
            return self.epoch < current.epoch
        return self.turn_id < current.turn_id or self.response_seq < current.response_seq
