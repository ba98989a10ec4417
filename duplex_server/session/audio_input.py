"""A live session's input audio on its way in: transport bytes -> input lane -> the core.

:class:`AudioInput` takes raw audio in the session's input format from the transport (a
binary WebSocket frame, an RTP payload, a media stream) or from the core (an
``input_audio_buffer.append``), counts it, and queues it on the session's
:class:`~duplex_server.session.input_lane.InputLane` (decode, resample, VAD off the loop);
a full lane refuses it (``input_backpressure``). The processed audio and its VAD events
reach the core once (``on_input_audio``), in order; a lane that fails fails the input.
The actions the core returns go to the session's ``apply``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from duplex_server.ops.metrics import Metrics
from duplex_server.protocol.commands import Action, ConfigureInput
from duplex_server.protocol.errors import ProtocolError
from duplex_server.protocol.machine import SessionMachine
from duplex_server.protocol.vad_events import VadEvent
from duplex_server.session.input_lane import InputLane, InputScheduler
from duplex_server.session.input_processor import VadBackend

log = logging.getLogger(__name__)

Apply = Callable[[list[Action]], None]


def _ignore(actions: list[Action]) -> None:
    """A closed input's ``apply``."""


class AudioInput:
    """One session's input path; ``clock``: the session's monotonic ms."""

    def __init__(
        self,
        core: SessionMachine,
        inputs: InputScheduler,
        *,
        vad_backend: VadBackend,
        max_backlog: int,
        metrics: Metrics,
        apply: Apply,
        clock: Callable[[], float],
        on_barrier: Callable[[], None] | None = None,
    ) -> None:
        self.core = core
        self.metrics = metrics
        self.clock = clock
        self._apply = apply
        self.lane = InputLane(
            inputs, vad_backend, max_backlog, self._processed, self._failed, on_barrier
        )

    @property
    def backlog(self) -> int:
        """Bytes queued on the lane and not processed yet."""
        return self.lane.backlog

    def receive(self, data: bytes) -> None:
        """Raw audio in the session's input format from the transport."""
        if data and not self.core.closed:
            self.put(data)

    def receive_frame(self, data: bytes) -> None:
        """A client's binary WebSocket frame: whole samples, or refused (and dropped)."""
        core = self.core
        try:
            core.config.input_format.check_frame(len(data))
        except ProtocolError as exc:
            self._apply(core.error(exc))
            return
        if data and not core.closed:
            core.frame_received(len(data))
        self.receive(data)

    def put(self, data: bytes) -> None:
        """Queue ``data`` on the lane, or refuse it (``input_backpressure``) when full."""
        core = self.core
        if not self.lane.put(data):
            self._apply(core.input_refused())
            return
        core.audio_received(len(data))
        self.metrics.count_audio_in(core.config.input_format.duration_ms(len(data)))

    def configure(self, action: ConfigureInput) -> None:
        """The session's input format or turn detection changed (after what is queued)."""
        self.lane.configure(action.format, action.turn_detection, action.noise_reduction)

    def close(self) -> None:
        """The session ended: queued audio is dropped and nothing more reaches the core (the
        session's ``apply`` is let go: an ended session is freed at once)."""
        self.lane.close()
        self._apply = _ignore

    def _processed(self, pcm: bytes, vad: list[VadEvent]) -> None:
        self._apply(self.core.on_input_audio(pcm, vad, self.clock()))

    def _failed(self, exc: BaseException) -> None:
        log.error("%s: input processing failed", self.core.session_id, exc_info=exc)
        self._apply(self.core.input_failed())
