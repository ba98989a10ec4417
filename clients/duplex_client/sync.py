"""A thin blocking wrapper: the asyncio client on a private event loop in a thread.

Built like the async client, with ``connect`` (which returns once ``session.created``
arrived; ``SyncDuplexClient(url, ...)`` does the same):

>>> with SyncDuplexClient.connect("ws://127.0.0.1:8000/v1/realtime") as client:
...     client.update_session({"output_modalities": ["text"]})
...     client.send_text("hello")
...     for event in client.events(timeout_s=30):
...         if event.type == "response.done": break
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from duplex_client import events as ev
from duplex_client.audio_input import AudioInput
from duplex_client.client import DuplexClient
from duplex_client.errors import SessionEnded

T = TypeVar("T")


class SyncDuplexClient:
    """A connected session, blocking. Build it with :meth:`connect`; close it with
    :meth:`close` (or use it as a context manager)."""

    @classmethod
    def connect(
        cls,
        url: str,
        *,
        api_key: str | None = None,
        heartbeat_s: float = 10.0,
        resume_attempts: int = 5,
        resume_backoff_s: float = 0.2,
        open_timeout_s: float = 10.0,
    ) -> SyncDuplexClient:
        """Open a session, as ``await DuplexClient.connect(url, ...)`` does (same arguments)."""
        return cls(
            url,
            api_key=api_key,
            heartbeat_s=heartbeat_s,
            resume_attempts=resume_attempts,
            resume_backoff_s=resume_backoff_s,
            open_timeout_s=open_timeout_s,
        )

    def __init__(self, url: str, **connect_kw: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="duplex-client-loop", daemon=True
        )
        self._thread.start()
        try:
            self.client: DuplexClient = self._run(DuplexClient.connect(url, **connect_kw))
        except BaseException:
            self._stop()
            raise

    def _run(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def _stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    @property
    def session_id(self) -> str:
        return self.client.session_id

    def update_session(self, session: ev.SessionParam | Mapping[str, Any]) -> None:
        self._run(self.client.update_session(session))

    def send_audio(
        self, audio: AudioInput, sample_rate: int | None = None, *, realtime: bool = False
    ) -> None:
        self._run(self.client.send_audio(audio, sample_rate, realtime=realtime))

    def send_wav(self, path: str | Path, *, realtime: bool = True) -> None:
        self._run(self.client.send_wav(path, realtime=realtime))

    def send_text(self, text: str, *, respond: bool = True) -> None:
        self._run(self.client.send_text(text, respond=respond))

    def send_event(self, event: ev.ClientEvent) -> None:
        self._run(self.client.send_event(event))

    def commit(self) -> None:
        self._run(self.client.commit())

    def barge_in(self) -> None:
        self._run(self.client.barge_in())

    def ack_playback(self, item_id: str, played_ms: float) -> None:
        self._run(self.client.ack_playback(item_id, played_ms))

    def next_event(self, timeout_s: float | None = None) -> ev.AnyServerEvent:
        return self._run(self.client.next_event(timeout_s))

    def events(self, timeout_s: float | None = None) -> Iterator[ev.AnyServerEvent]:
        """Events until the session ends; ``timeout_s`` bounds the wait for each one."""
        while True:
            try:
                event = self.next_event(timeout_s)
            except SessionEnded:
                return
            yield event

    def close(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self._run(self.client.close(), 30.0)
        finally:
            self._stop()

    def __enter__(self) -> SyncDuplexClient:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
