"""The trace context that crosses the server/engine boundary: a W3C ``traceparent``.

The front end writes its session's and its turns' span contexts onto the calls that start
work (``OpenCall``, ``CommitCall``, ``SignalCall(input.pause)``) with
:func:`traceparent_of`; the engine reads them back with :func:`context_of` and makes its
stage spans children of them. Only the OpenTelemetry API is used.
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()


def context_of(traceparent: str | None) -> Context | None:
    """The context a ``traceparent`` names (None: absent or not valid)."""
    if not traceparent:
        return None
    ctx = _PROPAGATOR.extract({"traceparent": traceparent})
    if not trace.get_current_span(ctx).get_span_context().is_valid:
        return None
    return ctx


def traceparent_of(span: Span) -> str | None:
    """``span``'s W3C ``traceparent`` (None: the span has no valid context)."""
    if not span.get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent")
