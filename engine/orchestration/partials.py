"""Live partial user transcripts while the user speaks (pocketsphinx, streaming).

Whisper produces the final transcript of a turn; pocketsphinx, fed with every appended
chunk, gives the client something to show while the user is still talking.

pocketsphinx holds the GIL while it decodes (and for ~0.4 s while a decoder is built), so
decoding runs in a child process: the server's event loop and the orchestrator never wait
on it (`python -m engine.orchestration.partials_child`, framed msgpack over its stdin and stdout; no
multiprocessing, so no `__main__` guard is needed by programs that embed the engine). Two
threads here move the data (a sender and a receiver). Partials are best
effort: a session beyond ``max_streams`` concurrent decoders, or a child more than
``max_backlog`` chunks behind, gets no partials (the final transcript is unaffected).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Literal

import msgspec

from engine.orchestration.partials_child import read_frame, write_frame

log = logging.getLogger(__name__)

_Op = tuple[Literal["feed", "reset", "drop"], str, int, bytes]


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
        self._proc: subprocess.Popen[bytes] | None = None
        self._threads: list[threading.Thread] = []
        self.dropped = 0
        self._closing = False

    def start(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "engine.orchestration.partials_child", str(self._max_streams)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
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
        """Stop the child (an empty frame, then a kill if it does not exit in 10 s) and the
        threads. Safe when the child is already gone: its pipes may be broken."""
        self._closing = True
        self._q.put(None)
        for t in self._threads:
            t.join(timeout=10)
        proc = self._proc
        if proc is not None:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    # a write the child never read stays buffered, and close() flushes it:
                    # BrokenPipeError once the child is gone (nothing is lost by ignoring it)
                    with contextlib.suppress(OSError):
                        pipe.close()
            log.info("partials process stopped (exit status %s)", proc.returncode)

    def _send_loop(self) -> None:
        assert self._proc is not None and self._proc.stdin is not None
        out = self._proc.stdin
        encode = msgspec.msgpack.Encoder()
        while True:
            op = self._q.get()
            try:
                write_frame(out, b"" if op is None else encode.encode(op))
            except (OSError, ValueError):
                if op is not None and not self._closing:
                    log.warning("the partials process is gone; no more partial transcripts")
                return
            if op is None:
                return

    def _recv_loop(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        decode = msgspec.msgpack.Decoder(tuple[str, int, str])
        while (frame := read_frame(self._proc.stdout)) is not None:
            sid, gen, text = decode.decode(frame)
            try:
                self._on_partial(sid, gen, text)
            except Exception:
                log.exception("partial transcript delivery failed")
