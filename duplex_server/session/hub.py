"""The live sessions and attached transports of one app, and the send watchdog.

Transport-agnostic: a transport registers its writer
(:class:`~duplex_server.session.writer.QueuedWriter`) in :attr:`Hub.sockets` (for the
watchdog, metrics and shutdown) and opens or resumes sessions through :attr:`Hub.sessions`.
"""

from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import Executor
from typing import Protocol

from duplex_contract.voices import VoiceCatalog
from duplex_server.client_secrets import ClientSecrets
from duplex_server.config import AppConfig
from duplex_server.ops.metrics import Metrics
from duplex_server.ops.tracing import Tracing
from duplex_server.protocol import events as ev
from duplex_server.protocol.codec import INPUT_FORMATS, OUTPUT_FORMATS
from duplex_server.protocol.errors import CloseCode
from duplex_server.session.input_lane import InputScheduler
from duplex_server.session.live import SessionLimits
from duplex_server.session.registry import Sessions


class Transport(Protocol):
    """What the hub needs of an attached transport (its writer)."""

    #: loop time when the frame being written started (None: not in a send)
    send_since: float | None

    def send_stalled(self) -> None: ...

    def close(self, code: int, reason: str) -> None: ...

    @property
    def queued_bytes(self) -> int: ...


class Hub:
    """The sockets of one app, its live sessions, and the send watchdog."""

    def __init__(
        self,
        config: AppConfig,
        metrics: Metrics,
        executor: Executor,
        voices: VoiceCatalog | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        s, e = config.server, config.engine
        self.config, self.metrics, self.keys = config, metrics, s.keys()
        self.secrets = ClientSecrets.from_env()  # ephemeral client secrets (mint and check)
        #: stages that only simulate (backend sim): each session is warned it hears silence
        self.simulated = sorted(n for n, st in e.stages.items() if st.backend == "sim")
        limits = SessionLimits(
            s.journal_max_bytes, s.journal_max_age_s, s.input_backlog_bytes, e.vad.backend
        )
        inputs = InputScheduler(executor, s.vad_threads)
        self.sessions = Sessions(
            limits,
            inputs,
            metrics,
            instructions=e.default_instructions,
            model=s.model_name,
            output_rate=e.output_sample_rate,
            route_key=s.route_key,
            voices=voices,
            tracing=tracing,
        )
        self.sockets: set[Transport] = set()
        self.closing = False
        self.draining = False  # SIGTERM: no new sessions or resumes (duplex_server/ops/drain.py)
        self.no_connections = asyncio.Event()
        self._watchdog: asyncio.Task[None] | None = None

    def capabilities(self) -> ev.Capabilities:
        s, e = self.config.server, self.config.engine
        return ev.Capabilities(
            supports_barge_in=True,
            supports_session_resume=True,
            input_audio_formats=list(INPUT_FORMATS),
            output_audio_formats=list(OUTPUT_FORMATS),
            turn_detection=["server_vad", "semantic_vad", "none"],
            vad_backend=e.vad.backend,
            max_frame_bytes=s.max_frame_bytes,
            journal_max_bytes=s.journal_max_bytes,
            journal_max_age_s=s.journal_max_age_s,
        )

    def ensure_watchdog(self) -> None:
        if self._watchdog is None or self._watchdog.done():
            self._watchdog = asyncio.create_task(self._watch_sends(), name="send-watchdog")

    async def _watch_sends(self) -> None:
        """Slow-client policy: a frame whose send has not finished in ``send_timeout_s``."""
        timeout = self.config.server.send_timeout_s
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(min(1.0, timeout / 5))
            now = loop.time()
            for sock in list(self.sockets):
                if sock.send_since is not None and now - sock.send_since > timeout:
                    sock.send_stalled()

    async def shutdown(self, grace_s: float) -> None:
        """Ordered: stop accepting, tell sockets (1001), wait up to grace, cancel the rest."""
        self.closing = True
        for sock in list(self.sockets):
            sock.close(CloseCode.GOING_AWAY, "server shutting down")
        if self.sockets:
            self.no_connections.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.no_connections.wait(), grace_s)
        if self._watchdog is not None:
            self._watchdog.cancel()
        await self.sessions.shutdown(grace_s)
