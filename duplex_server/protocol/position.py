"""Where a session stands in the engine (pure): the epoch the core decided and the engine's
turn and response counters it adopted.

Every engine call the core decides carries the epoch it was decided at; the runtime fences
it with :meth:`EnginePosition.fence_for` when it is executed. A cancel advances the epoch at
once (:meth:`EnginePosition.advance`: the engine accepts exactly one epoch step per cancel);
a call result never moves the counters back (:meth:`EnginePosition.accepted`).
"""

from __future__ import annotations

from duplex_contract.fence import Fence


class EnginePosition:
    """One session's epoch and the engine's turn and response counters."""

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self.epoch = 0
        self.turn_id = 0
        self.response_seq = 0

    @property
    def fence(self) -> Fence:
        return self.fence_for(self.epoch)

    def fence_for(self, epoch: int) -> Fence:
        """The fence an engine call decided at ``epoch`` carries when it is executed."""
        return Fence(self.session_id, epoch, self.turn_id, self.response_seq)

    def advance(self) -> int:
        """A cancel: the epoch moves on by one; returns the epoch cancelled."""
        self.epoch += 1
        return self.epoch - 1

    def accepted(self, fence: Fence) -> None:
        """An engine call succeeded at ``fence``: adopt its counters (never move back)."""
        if (fence.turn_id, fence.response_seq) > (self.turn_id, self.response_seq):
            self.turn_id = max(self.turn_id, fence.turn_id)
            self.response_seq = max(self.response_seq, fence.response_seq)
        if fence.epoch > self.epoch:
            self.epoch = fence.epoch

    def adopt(self, fence: Fence) -> None:
        """A session taken over from another front end continues at the engine's position."""
        self.epoch = fence.epoch
        self.turn_id = fence.turn_id
        self.response_seq = fence.response_seq
