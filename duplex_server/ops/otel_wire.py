"""The messages between a traced process and its OTLP export child (duplex_server.ops.otel_export
-> duplex_server.ops.otel_child): ended spans as compact msgpack records, framed on a pipe.

A frame is a 4-byte big-endian length and a msgpack :data:`Message`:

* :class:`Hello`, first and once: the exporter's settings (endpoint, headers: they travel
  on the pipe, not on the command line, so an API key never shows in ``ps``) and the
  process's resource;
* :class:`Batch`: scopes first seen since the last batch, then ended spans.

A span is encoded once, when it ends (:func:`encode_span`, on the thread that ended it):
the batch carries those bytes as they are (``msgspec.Raw``), so the sending thread only
joins bytes. The child decodes a batch into :class:`SpanRecord` values and rebuilds the
SDK's ``ReadableSpan`` from them (:func:`readable_span`), which the real OTLP exporter
encodes as it would in the traced process.
"""

from __future__ import annotations

import struct
from types import MappingProxyType
from typing import Any

import msgspec
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util import BoundedList
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.span import TraceState

#: a frame's header: the length of the msgpack body that follows
HEADER = struct.Struct(">I")
#: the largest frame either side accepts (a batch is cut well below it)
MAX_FRAME = 64 * 1024 * 1024

Attributes = dict[str, Any]


class Hello(msgspec.Struct, tag="hello", array_like=True, frozen=True):
    endpoint: str
    headers: dict[str, str]
    timeout_s: float
    resource: Attributes
    resource_schema_url: str


class Scope(msgspec.Struct, array_like=True, frozen=True):
    """An instrumentation scope, named by ``index`` in the spans that follow."""

    index: int
    name: str
    version: str | None
    schema_url: str | None
    attributes: Attributes | None


class EventRecord(msgspec.Struct, array_like=True, frozen=True):
    name: str
    time_ns: int
    attributes: Attributes
    dropped_attributes: int = 0


class LinkRecord(msgspec.Struct, array_like=True, frozen=True):
    trace_id: bytes  # 16 bytes, big-endian
    span_id: int
    flags: int
    remote: bool
    attributes: Attributes
    dropped_attributes: int = 0


class SpanRecord(msgspec.Struct, array_like=True, frozen=True):
    """An ended span: ids as ints (the trace id as 16 bytes: msgpack ints stop at 64 bits)."""

    name: str
    scope: int
    trace_id: bytes
    span_id: int
    flags: int
    trace_state: list[tuple[str, str]] | None
    parent_id: int | None
    parent_remote: bool
    kind: int
    start_ns: int
    end_ns: int
    attributes: Attributes
    events: list[EventRecord]
    links: list[LinkRecord]
    status_code: int
    status_description: str | None
    dropped: tuple[int, int, int]  # attributes, events, links the SDK's limits dropped


class Batch(msgspec.Struct, tag="batch", array_like=True, frozen=True):
    scopes: list[Scope]
    spans: list[SpanRecord]


class OutBatch(msgspec.Struct, tag="batch", array_like=True, frozen=True):
    """:class:`Batch` as the sender writes it: spans already encoded."""

    scopes: list[Scope]
    spans: list[msgspec.Raw]


Message = Hello | Batch

_ENCODER = msgspec.msgpack.Encoder()


def _plain(attrs: Any) -> Attributes:
    """Attributes as a dict to encode. The SDK keeps an ended span's attributes in a
    ``BoundedAttributes``, which ``ReadableSpan.attributes`` wraps in a read-only
    ``MappingProxyType``: both ``copy()`` to a plain dict at C speed (~0.2 us), where a
    copy through the ``Mapping`` methods costs ~2 us per span. Any other mapping is copied."""
    if isinstance(attrs, BoundedAttributes | MappingProxyType):
        return dict(attrs.copy())
    return dict(attrs or ())


def encode_span(span: ReadableSpan, scope: int) -> bytes:
    """``span``'s record, encoded (the work a traced thread does per ended span)."""
    ctx = span.context
    parent = span.parent
    status = span.status
    events = [
        EventRecord(e.name, e.timestamp, _plain(e.attributes), e.dropped_attributes)
        for e in span.events
    ]
    links = [
        LinkRecord(
            lk.context.trace_id.to_bytes(16, "big"),
            lk.context.span_id,
            int(lk.context.trace_flags),
            lk.context.is_remote,
            _plain(lk.attributes),
            lk.dropped_attributes,
        )
        for lk in span.links
    ]
    state = ctx.trace_state
    record = SpanRecord(
        span.name,
        scope,
        ctx.trace_id.to_bytes(16, "big"),
        ctx.span_id,
        int(ctx.trace_flags),
        list(state.items()) if state else None,
        parent.span_id if parent is not None else None,
        parent is not None and parent.is_remote,
        span.kind.value,
        span.start_time or 0,
        span.end_time or 0,
        _plain(span.attributes),
        events,
        links,
        status.status_code.value,
        status.description,
        (span.dropped_attributes, span.dropped_events, span.dropped_links),
    )
    return _ENCODER.encode(record)


def scope_of(index: int, scope: InstrumentationScope) -> Scope:
    attrs = scope.attributes
    return Scope(index, scope.name, scope.version, scope.schema_url, dict(attrs) if attrs else None)


def frame(message: Hello | OutBatch) -> bytes:
    body = _ENCODER.encode(message)
    return HEADER.pack(len(body)) + body


# ---------------------------------------------------------------------------- the child's side
def resource_of(hello: Hello) -> Resource:
    return Resource(hello.resource, hello.resource_schema_url or None)


def instrumentation_scope(scope: Scope) -> InstrumentationScope:
    return InstrumentationScope(scope.name, scope.version, scope.schema_url, scope.attributes)


def _dropped(items: list[Any], dropped: int) -> list[Any] | BoundedList:  # type: ignore[type-arg]
    if not dropped:
        return items
    bounded = BoundedList.from_seq(len(items), items)
    bounded.dropped = dropped
    return bounded


def _event(e: EventRecord) -> Event:
    attributes: Any = e.attributes
    if e.dropped_attributes:
        attributes = _bounded_attributes(e.attributes, e.dropped_attributes)
    return Event(e.name, attributes, e.time_ns)


def _bounded_attributes(attrs: Attributes, dropped: int) -> Any:
    bounded = BoundedAttributes(maxlen=None, attributes=attrs, immutable=True)
    bounded.dropped = dropped
    return bounded


def readable_span(
    r: SpanRecord, resource: Resource, scopes: dict[int, InstrumentationScope]
) -> ReadableSpan:
    """The SDK span ``r`` was made from, as the OTLP exporter reads it."""
    trace_id = int.from_bytes(r.trace_id, "big")
    state = TraceState(r.trace_state) if r.trace_state else None
    context = SpanContext(trace_id, r.span_id, False, TraceFlags(r.flags), state)
    parent = None
    if r.parent_id is not None:
        parent = SpanContext(trace_id, r.parent_id, r.parent_remote, TraceFlags(r.flags), state)
    links = [
        Link(
            SpanContext(
                int.from_bytes(lk.trace_id, "big"), lk.span_id, lk.remote, TraceFlags(lk.flags)
            ),
            _bounded_attributes(lk.attributes, lk.dropped_attributes)
            if lk.dropped_attributes
            else lk.attributes,
        )
        for lk in r.links
    ]
    dropped_attrs, dropped_events, dropped_links = r.dropped
    attributes: Any = r.attributes
    if dropped_attrs:
        attributes = _bounded_attributes(r.attributes, dropped_attrs)
    return ReadableSpan(
        name=r.name,
        context=context,
        parent=parent,
        resource=resource,
        attributes=attributes,
        events=_dropped([_event(e) for e in r.events], dropped_events),
        links=_dropped(links, dropped_links),
        kind=SpanKind(r.kind),
        status=Status(StatusCode(r.status_code), r.status_description)
        if r.status_description is not None
        else Status(StatusCode(r.status_code)),
        start_time=r.start_ns,
        end_time=r.end_ns,
        instrumentation_scope=scopes.get(r.scope),
    )
