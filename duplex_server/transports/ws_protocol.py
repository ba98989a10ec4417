"""uvicorn's WebSocket protocol with fewer system calls, tasks and copies per frame.

A realtime client sends 50 frames a second and gets a stream of events back, so with
hundreds of sessions the per-frame path of the stock protocol was a measurable share of the
front end's CPU (docs/scale.md). :class:`BufferedReadsProtocol` changes three things:

* **Reads.** uvicorn 0.54's sans-I/O protocol stops reading the socket after every message
  until the app has taken it (``pause_reading``), and starts again when the app's queue is
  empty (``resume_reading``): two ``epoll_ctl`` calls and an event-loop round trip per
  frame. This one keeps reading while fewer than ``MAX_QUEUED`` messages wait and only then
  pauses, so flow control still bounds what a client can queue (at most ``MAX_QUEUED``
  messages of at most ``server.max_frame_bytes`` each; the session's input lane has its own
  byte budget behind it).
* **Direct delivery.** The app may set :attr:`~BufferedReadsProtocol.direct` (the realtime
  transport does, once its session runs): each whole message is then handed to it as it is
  parsed, on the same call stack, instead of through the ASGI receive queue, a dict and a
  task wake-up of the reader. Messages already queued go first: a message is handed over
  directly only while the queue is empty, so the order is the client's.
  ``websocket.disconnect`` still comes through the queue. A handler that raises closes the
  connection with 1011. The protocol is found in the ASGI scope's
  ``extensions["duplex.protocol"]``.
* **Writes.** The socket's writes of one event-loop iteration go out as one write
  (:class:`CorkedTransport`): an answer's events often come several at a time (an audio
  delta with its transcript delta, a response's closing events), and each had its own
  ``send`` system call. :meth:`~BufferedReadsProtocol.send_text_now` writes a text frame
  without the ASGI message and the str round trip (the app's frames are UTF-8 bytes
  already).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

log = logging.getLogger(__name__)

#: messages a connection may have waiting for the app before its socket stops being read
MAX_QUEUED = 16
#: where the ASGI scope holds the connection's protocol
SCOPE_KEY = "duplex.protocol"

#: the app's handler of a whole message: (text, None) or (None, bytes)
Direct = Callable[[str | None, bytes | None], None]


class CorkedTransport:
    """A transport whose writes of one event-loop iteration go out as one write.

    ``write`` collects; the first write of an iteration schedules :meth:`flush` with
    ``call_soon`` (it runs before the loop next waits for I/O). ``close`` writes what is
    pending first; ``abort`` drops it. Everything else is the transport's: flow control
    (``pause_writing`` / ``resume_writing`` reach the protocol as before) and
    ``get_write_buffer_size``, which counts the pending bytes too.
    """

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._parts: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not data:
            return
        if not self._parts:
            self._loop.call_soon(self.flush)
        self._parts.append(data)

    def flush(self) -> None:
        """Write what is pending, as one write."""
        if not self._parts:
            return
        parts, self._parts = self._parts, []
        if not self._transport.is_closing():
            self._transport.write(parts[0] if len(parts) == 1 else b"".join(parts))

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._parts = []
        self._transport.abort()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(map(len, self._parts))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class BufferedReadsProtocol(WebSocketsSansIOProtocol):
    """Pauses reading only once ``MAX_QUEUED`` messages wait for the app; hands messages to
    :attr:`direct` when the app set it; corks its writes per loop iteration."""

    #: the app's handler of each whole message (None: the ASGI receive queue, as uvicorn's)
    direct: Direct | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.transport = CorkedTransport(self.transport, self.loop)  # type: ignore[assignment]

    def handle_connect(self, event: Any) -> None:
        super().handle_connect(event)
        scope = getattr(self, "scope", None)
        if scope is not None:  # the handshake was accepted: the app's scope exists
            scope["extensions"][SCOPE_KEY] = self

    def send_receive_event_to_app(self) -> None:
        direct = self.direct
        if direct is not None and not self.close_sent and self.queue.empty():
            data = self.frames[0] if len(self.frames) == 1 else b"".join(self.frames)
            if self.curr_msg_data_type == "text":
                try:
                    text = data.decode()
                except UnicodeDecodeError:  # uvicorn's own handling: close with 1007
                    super().send_receive_event_to_app()
                    return
                self.frames = []
                self._hand(direct, text, None)
            else:
                self.frames = []
                self._hand(direct, None, data)
            return
        if self.read_paused or self.queue.qsize() + 1 >= MAX_QUEUED:
            super().send_receive_event_to_app()  # uvicorn's own rule: pause now
            return
        # below the bound: let uvicorn queue the message without pausing the socket
        self.read_paused = True
        try:
            super().send_receive_event_to_app()
        finally:
            self.read_paused = False

    def _hand(self, direct: Direct, text: str | None, data: bytes | None) -> None:
        """Call the app's handler; one that raises closes the connection (1011), as an
        app whose reader task failed would."""
        try:
            direct(text, data)
        except Exception:
            log.exception("the app's message handler failed; closing the connection")
            self.direct = None
            if not self.close_sent and not self.transport.is_closing():
                self.conn.send_close(1011)
                self.close_sent = True
                self.transport.write(b"".join(self.conn.data_to_send()))
                self.transport.close()

    def send_text_now(self, data: bytes) -> bool:
        """Write ``data`` (UTF-8) as a text frame now, if the connection is open and its
        writes are not paused; False: nothing was written (the caller sends it the ASGI way,
        which waits for the flow control or raises the disconnect)."""
        if (
            not self.handshake_complete
            or self.initial_response is not None
            or self.close_sent
            or self.disconnected
            or not self.writable.is_set()
        ):
            return False
        self.conn.send_text(data)
        self.transport.write(b"".join(self.conn.data_to_send()))
        return True
