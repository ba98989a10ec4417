"""Engine spans: one span per stage request (ASR, LLM, TTS, talker, codec), joined to the
trace of the front end that asked for the work.

The trace context crosses the engine's boundary as a W3C ``traceparent`` string on the
calls that start work (``OpenCall``: the session's span; ``CommitCall``: the turn's span),
so an engine in its own process behind many front ends puts its spans in each caller's
trace. A turn runs with its commit's context attached (:meth:`EngineTracing.turn`), and
every stage request awaited inside it is a child of that turn; work started outside a turn
(a speculative transcript at a pause, a draft response) is a child of the session's span.
Nothing is recorded without a caller's context (batch HTTP requests, or a front end that
does not trace), and the caller's sampling decision is followed (the ``traceparent``
flags), so an unsampled session costs the engine nothing but a context lookup.

The tracer comes from the process that hosts the engine (``duplex_server.ops.tracing``
builds it from ``server.otel``); the engine imports only the OpenTelemetry API.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer

from duplex_contract.tracecontext import context_of
from engine.messages import Priority, StageDone, StageOutput, StageRequest


class StageSpan:
    """The span of one stage request, filled in as its outputs arrive."""

    __slots__ = ("_first", "_started", "batch_size", "done", "outputs", "span")

    def __init__(self, span: Span) -> None:
        self.span = span
        self._started = time.perf_counter()
        self._first = False
        self.outputs = 0
        self.batch_size = 0  # the largest step this request took part in (0: unknown)
        self.done: StageDone | None = None

    def output(self, out: StageOutput) -> None:
        if not self._first:
            self._first = True
            ms = (time.perf_counter() - self._started) * 1000
            self.span.add_event("first_output", {"duplex.first_output_ms": round(ms, 1)})
        if isinstance(out, StageDone):
            self.done = out
        else:
            self.outputs += 1

    def end(self, error: BaseException | None = None) -> None:
        span, done = self.span, self.done
        span.set_attribute("duplex.outputs", self.outputs)
        if self.batch_size:
            span.set_attribute("duplex.batch_size", self.batch_size)
        # no StageDone, or the consumer let go (a cancelled task, a closed stream): aborted
        finish: str = done.finish_reason if done is not None else "aborted"
        if done is not None and done.tokens:
            span.set_attribute("duplex.tokens", done.tokens)
        if done is not None and done.prompt_tokens:
            span.set_attribute("duplex.prompt_tokens", done.prompt_tokens)
        if isinstance(error, asyncio.CancelledError | GeneratorExit):
            finish = "aborted"
        elif error is not None:
            finish = "error"
            span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        span.set_attribute("duplex.finish_reason", finish)
        span.set_attribute("duplex.cancelled", finish == "aborted")
        span.end()


_UNTRACED: contextlib.AbstractContextManager[None] = contextlib.nullcontext()


class _Attached:
    """``ctx`` attached to the running context while the block runs."""

    __slots__ = ("_ctx", "_token")

    def __init__(self, ctx: Context) -> None:
        self._ctx = ctx
        self._token: object | None = None

    def __enter__(self) -> None:
        self._token = otel_context.attach(self._ctx)

    def __exit__(self, *exc: object) -> None:
        if self._token is not None:
            otel_context.detach(self._token)  # type: ignore[arg-type]
            self._token = None


class EngineTracing:
    """The engine's tracer and the sessions' contexts (one per engine; loop thread only)."""

    def __init__(self, tracer: Tracer | None = None) -> None:
        self.tracer = tracer
        self._sessions: dict[str, Context] = {}

    @property
    def enabled(self) -> bool:
        return self.tracer is not None

    def session_opened(self, session_id: str, traceparent: str | None) -> None:
        if self.tracer is None:
            return
        ctx = context_of(traceparent)
        if ctx is not None:
            self._sessions[session_id] = ctx

    def session_closed(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    def turn(self, traceparent: str | None) -> contextlib.AbstractContextManager[None]:
        """Run with a turn's context attached: the stage requests awaited inside (and in
        the tasks started inside, which copy the context) are children of the front end's
        turn span. Without a ``traceparent``, with no context at all (nothing stale).
        (A class, not a generator: a generator context manager that an exception passes
        through keeps the exception's frames in a cycle, so an ended turn's objects would
        wait for the cyclic GC.)"""
        if self.tracer is None:
            return _UNTRACED
        return _Attached(context_of(traceparent) or Context())

    def start_stage(
        self, stage: str, replica: int, device: str | None, request: StageRequest
    ) -> StageSpan | None:
        """The span of ``request`` on ``stage``'s replica ``replica`` (None: not traced)."""
        tracer = self.tracer
        if tracer is None:
            return None
        ctx: Context | None = None
        if trace.get_current_span().get_span_context().is_valid:
            ctx = otel_context.get_current()
        elif request.session_id is not None:
            ctx = self._sessions.get(request.session_id)
        if ctx is None:
            return None
        attrs: dict[str, str | int | bool] = {
            "duplex.stage": stage,
            "duplex.replica": replica,
            "duplex.request_id": request.request_id,
            "duplex.priority": Priority(request.priority).name.lower(),
            "duplex.process": "engine",
        }
        if device is not None:
            attrs["duplex.device"] = device
        if request.session_id is not None:
            attrs["duplex.session_id"] = request.session_id
        span = tracer.start_span(
            f"engine.{stage}", context=ctx, kind=SpanKind.INTERNAL, attributes=attrs
        )
        if not span.is_recording():
            return None
        return StageSpan(span)
