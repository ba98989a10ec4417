"""What comes back from the engine, routed by one object for both clients.

:class:`EngineInbox` takes every message the transport receives: control results go to their
waiters (engine/api/waiters.py), session events and batch items to their mailboxes
(engine/api/mailboxes.py), and the engine's death (a fatal error from the engine, a lost
connection or a shutdown: :meth:`EngineInbox.die`) to everyone at once: every waiter and
every stream fails with the one :class:`EngineDeadError` (the first), and the death hooks
run once, on the client's loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from duplex_contract.control import ControlResult
from duplex_contract.errors import EngineDeadError
from engine.api.mailboxes import Mailboxes
from engine.api.waiters import CallWaiters
from engine.messages import EngineFatal, EngineOutput

log = logging.getLogger(__name__)


class EngineInbox:
    """The receiving side of an engine client: waiters, mailboxes and the engine's death."""

    def __init__(self) -> None:
        self.waiters = CallWaiters()
        self.mailboxes = Mailboxes()
        #: the engine's death, once it died (or was shut down)
        self.dead: EngineDeadError | None = None
        self._hooks: list[Callable[[EngineDeadError], None]] = []

    def on_dead(self, hook: Callable[[EngineDeadError], None]) -> None:
        """Call ``hook`` once, when the engine dies or is shut down."""
        self._hooks.append(hook)

    def receive(self, msg: ControlResult | EngineOutput) -> None:
        """One message from the engine: a control result, a session event or batch item,
        or the engine's fatal error."""
        if isinstance(msg, EngineFatal):
            self.die(EngineDeadError(msg.error.message))
        elif isinstance(msg, ControlResult):
            self.waiters.resolve(msg)
        else:
            self.mailboxes.deliver(msg)

    def die(self, exc: EngineDeadError) -> None:
        """The engine is gone: fail every waiter and stream (the first death wins)."""
        first = self.dead is None
        if self.dead is None:
            self.dead = exc
        self.waiters.fail(self.dead)
        self.mailboxes.end(self.dead)
        if first:
            for hook in self._hooks:
                try:
                    hook(self.dead)
                except Exception:
                    log.exception("engine death hook failed")
