"""The SDK's resend buffer: every input message it sent, numbered, until the server has it.

The server numbers a session's input messages (binary audio frames,
``input_audio_buffer.append``, ``conversation.item.create``) in order; the SDK numbers its
own the same way and sends the JSON ones with an explicit ``input_seq``. After a reconnect,
``session.resumed.last_input_seq`` says the highest number the session has, and
:meth:`InputLog.after` gives what must be sent again, in order. The log keeps at most
``max_bytes`` (the oldest entries go first; a resume that needs one of those logs a warning).
:meth:`InputLog.resend` sends them on the new socket, and remembers how far it went, so a
send that was waiting for that socket does not send its message a second time.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 8 * 1024 * 1024  # ~170 s of 24 kHz PCM16


class InputLog:
    """Numbered input messages sent and not yet known to be on the server."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self.last = 0  # the number of the newest message
        self.resent = 0  # input messages sent again after a reconnect
        self.resent_upto = 0  # input messages up to this number were sent by a resume
        self._entries: deque[tuple[int, str | bytes]] = deque()
        self._bytes = 0

    def next_seq(self) -> int:
        self.last += 1
        return self.last

    def add(self, seq: int, data: str | bytes) -> None:
        self._entries.append((seq, data))
        self._bytes += len(data)
        while self._bytes > self.max_bytes and len(self._entries) > 1:
            self._bytes -= len(self._entries.popleft()[1])

    def after(self, server_seq: int) -> list[tuple[int, str | bytes]]:
        """The server has every message up to ``server_seq``: forget those, return the rest."""
        while self._entries and self._entries[0][0] <= server_seq:
            self._bytes -= len(self._entries.popleft()[1])
        if self._entries and self._entries[0][0] > server_seq + 1:
            log.warning(
                "input %d..%d is no longer in the resend log: the server lacks it",
                server_seq + 1,
                self._entries[0][0] - 1,
            )
        return list(self._entries)

    async def resend(
        self, send: Callable[[str | bytes], Awaitable[None]], server_seq: int | None
    ) -> None:
        """Send again, in order, the input the resumed session lacks (None: a server
        without input numbering; nothing is re-sent, as before)."""
        if server_seq is None:
            return
        for seq, data in self.after(server_seq):
            await send(data)
            self.resent += 1
            self.resent_upto = seq

    def sent_by_resume(self, seq: int) -> bool:
        """Did a resume send message ``seq`` (so its own send must not)?"""
        return seq <= self.resent_upto
