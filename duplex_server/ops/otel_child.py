"""The OTLP export child (``python -m duplex_server.ops.otel_child``, started by
duplex_server.ops.otel_export): reads span batches from stdin (duplex_server.ops.otel_wire frames),
rebuilds the SDK's spans and exports them with the real ``OTLPSpanExporter`` (OTLP/HTTP,
protobuf), so the encoding's CPU and GIL time are spent outside the traced process.

It exports each batch as it arrives, and exits when stdin ends (the traced process shut
tracing down, or died): it never outlives the process that started it. SIGINT and SIGTERM
are ignored, so that the spans its parent flushes on the way out are still exported.
Export failures are logged on stderr (the parent's) by the exporter.
"""

from __future__ import annotations

import logging
import signal
import sys
from typing import BinaryIO

import msgspec
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from duplex_server.ops.otel_wire import (
    HEADER,
    MAX_FRAME,
    Batch,
    Hello,
    Message,
    instrumentation_scope,
    readable_span,
    resource_of,
)

log = logging.getLogger("duplex_server.ops.otel_child")


def _read_exact(stream: BinaryIO, n: int) -> bytes | None:
    """``n`` bytes, or None at the end of the stream (a frame cut short counts as the end)."""
    data = stream.read(n)
    return data if data is not None and len(data) == n else None


def read_frame(stream: BinaryIO) -> bytes | None:
    """The next frame's body, None at the end of the stream."""
    header = _read_exact(stream, HEADER.size)
    if header is None:
        return None
    (size,) = HEADER.unpack(header)
    if size > MAX_FRAME:
        raise ValueError(f"a frame of {size} bytes (the most: {MAX_FRAME})")
    body = _read_exact(stream, size)
    return body


def run(stream: BinaryIO) -> int:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    decoder = msgspec.msgpack.Decoder(Message)
    first = read_frame(stream)
    if first is None:
        return 0  # the parent closed before saying anything
    hello = decoder.decode(first)
    if not isinstance(hello, Hello):
        raise ValueError("the first frame is not a hello")
    resource = resource_of(hello)
    exporter = OTLPSpanExporter(
        endpoint=hello.endpoint, headers=dict(hello.headers), timeout=hello.timeout_s
    )
    scopes: dict[int, InstrumentationScope] = {}
    try:
        while (body := read_frame(stream)) is not None:
            batch = decoder.decode(body)
            if not isinstance(batch, Batch):
                raise ValueError("a second hello")
            for scope in batch.scopes:
                scopes[scope.index] = instrumentation_scope(scope)
            if batch.spans:
                exporter.export([readable_span(r, resource, scopes) for r in batch.spans])
    finally:
        exporter.shutdown()  # type: ignore[no-untyped-call]
    return 0


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=logging.WARNING, format="otel export child: %(levelname)s %(name)s: %(message)s"
    )
    try:
        return run(sys.stdin.buffer)
    except (ValueError, msgspec.DecodeError) as exc:
        log.error("bad input from the traced process: %s", exc)
        return 1


if __name__ == "__main__":
    sys.exit(main())
