"""Live partial user transcripts while the user speaks (pocketsphinx, streaming).

Whisper produces the final transcript of a turn; pocketsphinx, fed with every appended
chunk, gives the client something to show while the user is still talking.

pocketsphinx holds the GIL while it decodes (and for ~0.4 s while a decoder is built), so
decoding runs in a child process: the server's event loop and the orchestrator never wait
on it. Two threads here move data over one pipe (a sender and a receiver). Partials are best
effort: a session beyond ``max_streams`` concurrent decoders, or a child more than
``max_backlog`` chunks behind, gets no partials (the final transcript is unaffected).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import queue
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Literal

log = logging.getLogger(__name__)

_Op = tuple[Literal["feed", "reset", "drop"], str, int, bytes]
_WARM_DECODERS = 2


def _child_main(conn: Connection, max_streams: int) -> None:
    """The decoding process: ops in, ``(session_id, generation, text)`` out."""
    from engine.stages.asr_pocketsphinx import PocketsphinxStream

    free = [PocketsphinxStream() for _ in range(min(_WARM_DECODERS, max_streams))]
    streams: dict[str, PocketsphinxStream] = {}
    while True:
        try:
            op: _Op | None = conn.recv()
        except EOFError:
            return
        if op is None:
            return
        kind, sid, gen, pcm = op
        stream = streams.get(sid)
        if kind == "feed":
            if stream is None:
                if len(streams) >= max_streams:
                    continue
                stream = streams[sid] = free.pop() if free else PocketsphinxStream()
            text = stream.feed(pcm)
            if text:
                conn.send((sid, gen, text))
        elif stream is not None:
            stream.reset()
            if kind == "drop":
                free.append(streams.pop(sid))


class PartialTranscriber:
    """``on_partial(session_id, generation, text)`` is called from a receiver thread."""

    def __init__(
        self,
        on_partial: Callable[[str, int, str], None],
        *,
        max_streams: int = 8,
        max_backlog: int = 500,
    ) -> None:
        self._on_partial = on_partial
        self._max_streams = max_streams
        self._max_backlog = max_backlog
        self._q: queue.Queue[_Op | None] = queue.Queue()
        self._conn: Connection | None = None
        self._proc: mp.process.BaseProcess | None = None
        self._threads: list[threading.Thread] = []
        self.dropped = 0

    def start(self) -> None:
        ctx = mp.get_context("spawn")  # never fork a process that runs threads
        parent, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=_child_main, args=(child, self._max_streams), name="partials", daemon=True
        )
        self._proc.start()
        child.close()
        self._conn = parent
        self._threads = [
            threading.Thread(target=self._send_loop, name="partials-send", daemon=True),
            threading.Thread(target=self._recv_loop, name="partials-recv", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def feed(self, session_id: str, generation: int, pcm: bytes) -> None:
        if self._q.qsize() >= self._max_backlog:
            self.dropped += 1
            return
        self._q.put(("feed", session_id, generation, pcm))

    def reset(self, session_id: str) -> None:
        self._q.put(("reset", session_id, 0, b""))

    def drop(self, session_id: str) -> None:
        self._q.put(("drop", session_id, 0, b""))

    def close(self) -> None:
        self._q.put(None)
        for t in self._threads:
            t.join(timeout=10)
        if self._proc is not None:
            self._proc.join(timeout=10)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(timeout=5)
            self._proc.close()
        if self._conn is not None:
            self._conn.close()

    def _send_loop(self) -> None:
        assert self._conn is not None
        while True:
            op = self._q.get()
            try:
                self._conn.send(op)
            except (OSError, ValueError):
                log.exception("partials process is gone; no more partial transcripts")
                return
            if op is None:
                return

    def _recv_loop(self) -> None:
        assert self._conn is not None
        while True:
            try:
                sid, gen, text = self._conn.recv()
            except (EOFError, OSError):
                return  # the child exited (close) or died
            try:
                self._on_partial(sid, gen, text)
            except Exception:
                log.exception("partial transcript delivery failed")
