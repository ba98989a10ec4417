"""The session core's state: what every part of the session core shares.

:class:`CoreState` holds the session's identity, configuration, epoch and engine counters,
its conversation (:attr:`items`), response lifecycle (:attr:`responses`) and input turns
(:attr:`input`), and the two actions every part needs: :meth:`CoreState.error` (the one
place an exception becomes actions) and :meth:`CoreState.close`. The jobs built on it live
beside it: admission and resume (:mod:`.core_admission`), input turns (:mod:`.core_input`),
responses (:mod:`.core_responses`); :mod:`.session` joins them and dispatches.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from duplex_contract.fence import Fence
from duplex_server.protocol import events as ev
from duplex_server.protocol.codec import AudioFormat
from duplex_server.protocol.commands import (
    Action,
    Call,
    CloseSession,
    CloseSocket,
    Send,
)
from duplex_server.protocol.config import (
    EffectiveSession,
)
from duplex_server.protocol.errors import CloseCode, to_wire_error
from duplex_server.protocol.input import (
    InputTurns,
)
from duplex_server.protocol.input_seq import InputSequence
from duplex_server.protocol.items import Conversation
from duplex_server.protocol.playout import TalkOver
from duplex_server.protocol.responses import (
    Responses,
)
from duplex_server.protocol.usage import UsageMeter


def _identity(pcm: bytes, rate: int, fmt: AudioFormat) -> bytes:
    return pcm


class CoreState:
    """One session's protocol state; survives socket changes (resume, takeover)."""

    def __init__(
        self,
        session_id: str,
        config: EffectiveSession,
        *,
        lease_generation: int = 1,
        encode_output: Callable[[bytes, int, AudioFormat], bytes] = _identity,
    ) -> None:
        self.session_id = session_id
        self.config = config
        self.lease_generation = lease_generation
        self.epoch = 0
        self.turn_id = 0
        #: moments (ms, the caller's clock) of the turn being answered: response.done timing
        self.turn_moments: dict[str, float] = {}
        #: response id -> its timeline's origin (the transport adds the write moment)
        self.response_origin: dict[str, float] = {}
        self.response_seq = 0
        self.closed = False
        self.encode_output = encode_output
        self.token_hash = b""  # digest of the current resume token
        self._new_token = ""
        self.resuming = False  # a resume is waiting for the engine
        self.items = Conversation(session_id)
        self.now_ms = 0.0  # the time of the latest input (for the idle timeout)
        #: idle timeout: silence since (ms); None = not armed (fires once per silence)
        self.idle_since_ms: float | None = None
        self._partials: dict[str, str] = {}  # speech item -> live transcript sent so far
        self.responses = Responses()
        #: audio a media transport's far end still plays after its response ended
        self.talk_over = TalkOver()
        self.usage = UsageMeter()  # tokens and audio seconds (response.done, session.closed)
        # not a lambda over self: a reference cycle would keep a closed session until the
        # cyclic GC ran
        self.input = InputTurns(functools.partial(self.items.new_id, "item"))
        self.seqs = InputSequence()  # client input numbering (input exactly once)

    # ------------------------------------------------------------------ positions
    @property
    def position(self) -> Fence:
        return Fence(self.session_id, self.epoch, self.turn_id, self.response_seq)

    def fence_for(self, epoch: int) -> Fence:
        """The fence an engine call decided at ``epoch`` carries when it is executed."""
        return Fence(self.session_id, epoch, self.turn_id, self.response_seq)

    @property
    def response_active(self) -> bool:
        return self.responses.active

    @property
    def beta(self) -> bool:
        return self.config.event_names == "beta"

    def error(self, exc: BaseException, event_id: str | None = None) -> list[Action]:
        """The one place an exception becomes actions: the error event, maybe a close."""
        detail, close = to_wire_error(exc, event_id=event_id)
        out: list[Action] = [Send(ev.Error(error=detail))]
        if close is not None:
            out.append(CloseSocket(close, detail.code))
        return out

    def close(self, reason: str) -> list[Action]:
        if self.closed:
            return []
        self.closed = True
        return [
            Call(CloseSession(reason)),
            Send(ev.SessionClosed(reason=reason, usage=self.usage.total())),
            CloseSocket(CloseCode.NORMAL, reason),
        ]
