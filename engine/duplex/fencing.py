"""Fence rules as pure functions (the Fence itself is in :mod:`duplex_contract.fence`): the
session ids, the fence checks every fenced call passes, epoch merges and the stage request
id prefixes of a session, an epoch and a draft."""

from __future__ import annotations

import re
import uuid

from duplex_contract.errors import ControlError
from duplex_contract.fence import ROUTE_KEY as ROUTE_KEY
from duplex_contract.fence import Fence
from duplex_contract.fence import route_key_of as route_key_of


def new_session_id(route_key: str | None = None) -> str:
    """Server-allocated, never reused: ``sess_<32 hex>``, or ``sess_<route>_<32 hex>`` when
    the front end that opens it has a route key (a load balancer routes resumes on it)."""
    if route_key is None:
        return f"sess_{uuid.uuid4().hex}"
    return f"sess_{route_key}_{uuid.uuid4().hex}"


def initial_fence(session_id: str) -> Fence:
    return Fence(session_id=session_id, epoch=0, turn_id=0, response_seq=0)


def check_lease(generation: int, current: int) -> None:
    """A call of an older lease generation comes from a replaced attachment: ``stale_fence``."""
    if generation != current:
        raise ControlError(
            f"lease generation {generation} is not current ({current}): "
            "the session was resumed elsewhere",
            code="stale_fence",
        )


def check_fresh(fence: Fence, current: Fence) -> None:
    """A fence older than the session's is refused: ``stale_fence``."""
    if fence.is_stale_against(current):
        raise ControlError(
            f"stale fence {fence.key()} (current {current.key()})", code="stale_fence"
        )


def merge_forward(current: Fence, proposed: Fence) -> Fence:
    """The newest of two fences of one session, field by field; never moves backwards."""
    if proposed.epoch > current.epoch:
        return Fence(
            current.session_id,
            proposed.epoch,
            max(current.turn_id, proposed.turn_id),
            max(current.response_seq, proposed.response_seq),
        )
    return current


def epoch_prefix(session_id: str, epoch: int) -> str:
    """Prefix of every stage request id of one epoch of a session."""
    return f"{session_id}/e{epoch}/"


def draft_prefix(session_id: str, epoch: int, n: int) -> str:
    """Prefix of the stage requests of a session's ``n``-th draft response in ``epoch``
    (engine/orchestration/drafts.py)."""
    return f"{epoch_prefix(session_id, epoch)}draft{n}"


_DRAFT_REQUEST = re.compile(r"^[^/]+/e\d+/draft\d+/")


def is_draft_request(request_id: str) -> bool:
    """Is this stage request a draft response's (``sess_x/e3/draft7/llm``)?"""
    return _DRAFT_REQUEST.match(request_id) is not None


def session_prefix(session_id: str) -> str:
    return f"{session_id}/"
