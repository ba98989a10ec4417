"""OpenTelemetry traces (``server.otel``): one trace per session, exported over OTLP/HTTP.

:class:`Tracing` owns this process's tracer provider (its own, never the global one, so
two apps in one process keep their configs apart). :class:`SessionTrace` is one session's
trace; the live session tells it what happens, and it builds the spans:

* ``session``: the root, from the open to the end of the session's tasks; events
  ``barge_in``, ``resumed``;
* ``turn``: one per response, from the speech that led to it (else its commit) to
  ``response.done``, with the response's id, route, status and whether it was cancelled;
* under each turn, from the ``response.done`` timeline (docs/protocol.md §5.10) with its
  moments as the span times: ``vad.commit`` (last voiced audio -> the VAD's commit),
  ``asr`` (commit -> final transcript), ``llm.first_token``, ``tts.first_audio`` (TTS, or
  talker + codec) and ``audio.first_sent`` (the first audio from the engine -> written to
  the client);
* the engine's spans (engine/spans.py): the turn's ``traceparent`` goes with its commit
  and with the pause's speculation before it, the session's with the open call, so an
  engine in another process puts its per-stage-request spans (stage, replica, batch size)
  in this trace.

The spans are exported from a child process (duplex_server.ops.otel_export): this process only
encodes each ended span as a small record and pipes it there, so the OTLP exporter's
protobuf work never holds this process's GIL (the overhead: docs/protocol.md §13).

With ``server.otel.endpoint`` unset nothing here is built: no provider, no exporter.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer

from duplex_contract.tracecontext import traceparent_of
from duplex_server.config import OtelConfig
from duplex_server.ops.otel_export import ChildExportProcessor
from duplex_server.protocol import events as ev
from duplex_server.protocol.commands import Cancel, Commit, EngineCommand, Speculate

#: the timeline's child spans of a turn: (name, start moment(s), end moment), the first
#: start moment present counts (docs/protocol.md §5.10)
_TIMELINE: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("vad.commit", ("last_voice",), "speech_stopped"),
    ("asr", ("speech_stopped", "committed"), "transcript_ready"),
    ("audio.first_sent", ("first_audio",), "first_audio_sent"),
)


def wall_ns(monotonic_ms: float) -> int:
    """A ``time.monotonic()`` moment (ms) as Unix time in ns (what spans carry)."""
    return time.time_ns() - int((time.monotonic() * 1000.0 - monotonic_ms) * 1e6)


class Tracing:
    """This process's tracer provider and OTLP/HTTP exporter (``server.otel``)."""

    def __init__(self, config: OtelConfig, *, process: str = "server") -> None:
        assert config.endpoint is not None
        resource = Resource.create({"service.name": config.service_name, "duplex.process": process})
        sampler = ParentBased(TraceIdRatioBased(config.sample_ratio))
        self.provider = TracerProvider(resource=resource, sampler=sampler)
        self.export = ChildExportProcessor(
            config.endpoint,
            dict(config.headers),
            resource,
            export_delay_ms=config.export_delay_ms,
            max_queue=config.max_queue,
        )
        self.provider.add_span_processor(self.export)
        self.tracer: Tracer = self.provider.get_tracer("duplex_server")

    @classmethod
    def from_config(cls, config: OtelConfig, *, process: str = "server") -> Tracing | None:
        """The tracing ``config`` asks for; None when it is off (no endpoint)."""
        return None if config.endpoint is None else cls(config, process=process)

    def engine_tracer(self) -> Tracer:
        """The tracer of an engine hosted by this process."""
        return self.provider.get_tracer("engine")

    def session(self, route_key: str | None = None) -> SessionTrace:
        return SessionTrace(self.tracer, route_key)

    def shutdown(self) -> None:
        """Export what is left and stop the export child (blocks: up to ~10 s)."""
        self.provider.shutdown()


class SessionTrace:
    """One session's trace: its root span; the turn the user's speech is making (begun at
    the speech's start, not committed yet); and the turns whose responses were asked for
    and have not finished (oldest first: responses finish in the order asked)."""

    def __init__(self, tracer: Tracer, route_key: str | None) -> None:
        self.tracer = tracer
        attrs = {"duplex.route_key": route_key} if route_key else {}
        self.span: Span = tracer.start_span("session", kind=SpanKind.SERVER, attributes=attrs)
        self._start_ns = time.time_ns()
        self.session_id = ""
        self.traceparent = traceparent_of(self.span)
        self._turns: deque[_Turn] = deque()
        self._next: _Turn | None = None  # the turn the speech under way will commit
        self._ended = False

    def opened(self, session_id: str) -> None:
        self.session_id = session_id
        self.span.set_attribute("duplex.session_id", session_id)

    def refused(self, error: BaseException) -> None:
        """The engine did not open the session: the trace ends with the error."""
        self.span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        self.end()

    # ------------------------------------------------------------------ what happened
    def on_event(self, event: ev.ServerEvent, now_ms: float, input_ms: float) -> None:
        """A server event other than ``response.done`` is sent (``now_ms``: monotonic;
        ``input_ms``: the session's input audio clock)."""
        if isinstance(event, ev.SpeechStarted):
            if self._next is None:  # the VAD decides after some speech: date it back
                start = wall_ns(now_ms - max(0.0, input_ms - event.audio_start_ms))
                self._next = self._turn(start)
        elif isinstance(event, ev.InputCleared) and self._next is not None:
            self._next.span.set_attribute("duplex.status", "input_cleared")
            self._next.span.end()
            self._next = None
        elif isinstance(event, ev.SessionClosed):
            self.span.set_attribute("duplex.close_reason", event.reason)

    def command(self, cmd: EngineCommand) -> EngineCommand:
        """An engine call the core decided: a commit asking for a response, or a pause's
        speculation, carries its turn's ``traceparent`` (the engine's work joins the
        turn); a cancel drops the turns of responses that had not started."""
        if isinstance(cmd, Commit) and cmd.respond:
            turn = self._next or self._turn(None)  # no speech: the turn starts now
            self._next = None
            self._turns.append(turn)
            return dataclasses.replace(cmd, traceparent=traceparent_of(turn.span))
        if isinstance(cmd, Speculate) and cmd.event == "input.pause" and self._next is not None:
            return dataclasses.replace(cmd, traceparent=traceparent_of(self._next.span))
        if isinstance(cmd, Cancel):
            self.requests_dropped()
        return cmd

    def _turn(self, start_ns: int | None) -> _Turn:
        """A turn span from ``start_ns`` (None: now), never before the session's."""
        start_ns = time.time_ns() if start_ns is None else max(start_ns, self._start_ns)
        ctx = trace.set_span_in_context(self.span)
        attrs = {"duplex.session_id": self.session_id}
        span = self.tracer.start_span("turn", context=ctx, attributes=attrs, start_time=start_ns)
        return _Turn(span, start_ns)

    def turn_refused(self, error: BaseException) -> None:
        """The engine refused the last commit: its turn ends with the error."""
        if self._turns:
            turn = self._turns.pop().span
            turn.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
            turn.set_attribute("duplex.status", "failed")
            turn.end()

    def requests_dropped(self) -> None:
        """A cancel dropped the responses asked for that had not started."""
        while self._turns:
            turn = self._turns.popleft().span
            turn.set_attribute("duplex.status", "cancelled")
            turn.set_attribute("duplex.cancelled", True)
            turn.end()

    def resumed(self, lease_generation: int) -> None:
        attrs = {"duplex.lease_generation": lease_generation}
        self.span.add_event("resumed", attrs)
        if self._turns:
            self._turns[0].span.add_event("resumed", attrs)
        elif self._next is not None:
            self._next.span.add_event("resumed", attrs)

    def response_done(self, event: ev.ResponseDone, origin_ms: float | None) -> None:
        """``response.done`` is written: the turn span gets the timeline's spans and ends.
        ``origin_ms``: the monotonic moment the timeline's moments count from."""
        resp = event.response
        # (none: a response no commit of this trace asked for)
        current = self._turns.popleft() if self._turns else self._turn(None)
        turn = current.span
        cancelled = resp.status == "cancelled"
        details = resp.status_details
        reason = details.reason if details is not None else None
        turn.set_attributes(
            {
                "duplex.session_id": self.session_id,
                "duplex.response_id": resp.id,
                "duplex.route": "voice" if "audio" in resp.output_modalities else "text",
                "duplex.status": resp.status,
                "duplex.cancelled": cancelled,
                "duplex.epoch": resp.epoch,
            }
        )
        if reason:
            turn.set_attribute("duplex.reason", reason)
        if cancelled and reason == "turn_detected":
            turn.add_event("barge_in")
            self.span.add_event("barge_in", {"duplex.response_id": resp.id})
        if resp.status == "failed":
            error = details.error if details is not None else None
            turn.set_status(Status(StatusCode.ERROR, error.code if error else "failed"))
        timing = resp.timing
        if timing is not None and origin_ms is not None:
            self._timeline(current, timing, origin_ms)
        turn.end()

    def _timeline(self, turn: _Turn, timing: ev.ResponseTiming, origin_ms: float) -> None:
        at = {k: wall_ns(origin_ms + v) for k, v in timing.moments_ms.items()}
        seg = timing.segments_ms
        ctx = trace.set_span_in_context(turn.span)
        spans: list[tuple[str, int, int]] = []
        for name, starts, end in _TIMELINE:
            start = next((s for s in starts if s in at), None)
            if start is not None and end in at:
                spans.append((name, at[start], at[end]))
        created = at.get("response_created")
        if created is not None and "llm" in seg:
            llm_end = created + int(seg["llm"] * 1e6)
            spans.append(("llm.first_token", created, llm_end))
            if "tts" in seg:
                spans.append(("tts.first_audio", llm_end, llm_end + int(seg["tts"] * 1e6)))
        for name, start_ns, end_ns in spans:
            start_ns = max(start_ns, turn.start_ns)  # an estimate never precedes its turn
            span = self.tracer.start_span(name, context=ctx, start_time=start_ns)
            span.end(end_time=max(start_ns, end_ns))

    def end(self) -> None:
        """The session's tasks ended: unfinished turns and the session span end."""
        if self._ended:
            return
        self._ended = True
        self.requests_dropped()
        if self._next is not None:
            self._next.span.set_attribute("duplex.status", "no_response")
            self._next.span.end()
            self._next = None
        self.span.end()


@dataclass(frozen=True, slots=True)
class _Turn:
    span: Span
    start_ns: int  # Unix time (ns)
