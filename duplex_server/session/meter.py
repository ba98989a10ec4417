"""What a live session measures of its calls and events: latency, usage and errors.

:class:`SessionMeter` watches the engine calls the session makes (a cancel or a commit that
asks for a response starts a clock), the events its transport writes (the first audio after a
commit: time to first audio; the ``response.done`` of a cancelled response: barge-in latency;
each audio chunk's time in the server) and the events it sends: ``response.done`` gets the
moment its first audio delta was written (``first_audio_sent``, rebased on the response's
origin) and its segments observed in ``duplex_turn_segment_seconds``; usage and error codes
are counted. The clock is passed in (``perf_counter`` / ``monotonic`` ms, by the session).
"""

from __future__ import annotations

import msgspec

from duplex_server.ops.metrics import Metrics
from duplex_server.protocol import events as ev
from duplex_server.protocol.commands import Cancel, Commit, EngineCommand
from duplex_server.session.attach import Outgoing


class SessionMeter:
    """One session's latency clocks and metrics."""

    def __init__(self, session_id: str, metrics: Metrics) -> None:
        self.session_id = session_id
        self.metrics = metrics
        self.cancel_t: float | None = None  # perf_counter of the last cancel
        self.commit_t: float | None = None  # ... of the last commit that asked for a response
        self._first_sent: dict[str, float] = {}  # response id -> first audio delta written (ms)

    def called(self, cmd: EngineCommand, now: float) -> None:
        """The session queues ``cmd`` for the engine at ``now`` (perf_counter)."""
        if isinstance(cmd, Cancel):
            self.cancel_t = now
        elif isinstance(cmd, Commit) and cmd.respond:
            self.commit_t = now

    def sent(self, item: Outgoing, now: float, now_ms: float) -> None:
        """A transport wrote ``item`` at ``now`` (perf_counter) / ``now_ms`` (monotonic)."""
        event, metrics = item.event, self.metrics
        if isinstance(event, ev.AudioDelta):
            self._first_sent.setdefault(event.response_id, now_ms)
            if item.t_in:
                metrics.chunk_overhead.observe(now - item.t_in)
            if self.commit_t is not None:
                metrics.ttfa.observe(now - self.commit_t)
                self.commit_t = None
        elif isinstance(event, ev.ResponseDone) and event.response.status == "cancelled":
            if self.cancel_t is not None:
                metrics.bargein.observe(now - self.cancel_t)
                self.cancel_t = None

    def response_done(self, event: ev.ResponseDone, origins: dict[str, float]) -> ev.ResponseDone:
        """``event`` with its first audio delta's write moment, its segments observed and its
        usage counted. ``origins``: the responses' origins (ms); this one's is taken."""
        event = self._timed(event, origins)
        if event.response.usage is not None:
            self.metrics.count_usage(event.response.usage)
        return event

    def observe(self, event: ev.ServerEvent) -> None:
        """Any other event the session sends: error codes counted."""
        if isinstance(event, ev.Error):
            self.metrics.errors.labels(event.error.code).inc()

    def _timed(self, event: ev.ResponseDone, origins: dict[str, float]) -> ev.ResponseDone:
        resp = event.response
        sent = self._first_sent.pop(resp.id, None)
        self._first_sent.clear()  # one response at a time: older entries are stale
        timing = resp.timing
        if timing is None:
            return event
        if sent is not None:
            moments, segs = dict(timing.moments_ms), dict(timing.segments_ms)
            # moments are relative to the response's origin: rebase the write time
            base = origins.pop(resp.id, None)
            if base is not None:
                moments["first_audio_sent"] = round(sent - base, 1)
                if "first_audio" in moments:
                    segs["send"] = round(moments["first_audio_sent"] - moments["first_audio"], 1)
                segs["server_total"] = moments["first_audio_sent"]
            timing = ev.ResponseTiming(moments_ms=moments, segments_ms=segs)
            event = msgspec.structs.replace(
                event, response=msgspec.structs.replace(resp, timing=timing)
            )
        if resp.status == "completed" or "first_audio_sent" in timing.moments_ms:
            for name, ms in timing.segments_ms.items():
                self.metrics.turn_segment.labels(name).observe(max(0.0, ms) / 1000)
        return event
