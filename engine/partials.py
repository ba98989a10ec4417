"""Live partial user transcripts while the user speaks (pocketsphinx, streaming).

Whisper produces the final transcript of a turn; pocketsphinx, fed with every appended
chunk, gives the client something to show while the user is still talking. All decoding
runs in one worker thread (never on an event loop). Partials are best effort: a session
beyond ``max_streams`` concurrent decoders, or a worker more than ``max_backlog`` chunks
behind, gets no partials (the final transcript is unaffected).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Literal

from engine.stages.asr_pocketsphinx import PocketsphinxStream

log = logging.getLogger(__name__)

_Op = tuple[Literal["feed", "reset", "drop"], str, int, bytes] | None


class PartialTranscriber:
    """``on_partial(session_id, generation, text)`` is called from the worker thread."""

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
        self._q: queue.Queue[_Op] = queue.Queue()
        self._streams: dict[str, PocketsphinxStream] = {}
        self._thread: threading.Thread | None = None
        self.dropped = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._main, name="partials", daemon=True)
        self._thread.start()

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
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _main(self) -> None:
        while (op := self._q.get()) is not None:
            kind, sid, gen, pcm = op
            try:
                if kind == "feed":
                    self._feed(sid, gen, pcm)
                elif kind == "reset":
                    stream = self._streams.get(sid)
                    if stream is not None:
                        stream.reset()
                else:
                    self._streams.pop(sid, None)
            except Exception:
                log.exception("partial transcription failed for %s", sid)
                self._streams.pop(sid, None)

    def _feed(self, sid: str, gen: int, pcm: bytes) -> None:
        stream = self._streams.get(sid)
        if stream is None:
            if len(self._streams) >= self._max_streams:
                return
            stream = self._streams[sid] = PocketsphinxStream()
        text = stream.feed(pcm)
        if text:
            self._on_partial(sid, gen, text)
