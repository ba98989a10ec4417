"""uvicorn's WebSocket protocol with fewer system calls per received frame.

uvicorn 0.54's sans-I/O protocol stops reading the socket after every message until the app
has taken it (``pause_reading``), and starts again when the app's queue is empty
(``resume_reading``): two ``epoll_ctl`` calls and an event-loop round trip per frame. A
realtime client sends 50 frames a second, so with hundreds of sessions that bookkeeping was
a measurable share of the front end's CPU (docs/scale.md).

:class:`BufferedReadsProtocol` keeps reading while fewer than ``MAX_QUEUED`` messages wait
and only then pauses, so flow control still bounds what a client can queue (at most
``MAX_QUEUED`` messages of at most ``server.max_frame_bytes`` each; the session's input lane
has its own byte budget behind it).
"""

from __future__ import annotations

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

#: messages a connection may have waiting for the app before its socket stops being read
MAX_QUEUED = 16


class BufferedReadsProtocol(WebSocketsSansIOProtocol):
    """Pauses reading only once ``MAX_QUEUED`` messages wait for the app."""

    def send_receive_event_to_app(self) -> None:
        if self.read_paused or self.queue.qsize() + 1 >= MAX_QUEUED:
            super().send_receive_event_to_app()  # uvicorn's own rule: pause now
            return
        # below the bound: let uvicorn queue the message without pausing the socket
        self.read_paused = True
        try:
            super().send_receive_event_to_app()
        finally:
            self.read_paused = False
