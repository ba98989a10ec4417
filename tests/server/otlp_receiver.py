"""An in-process OTLP/HTTP trace receiver for tests: a tiny HTTP server on 127.0.0.1 that
decodes each export as the real protobuf (``ExportTraceServiceRequest``) and keeps the
spans, as a collector would receive them."""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from tests.server.harness import UNIT
from tests.server.procs import pid_of_client


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    return None if kind is None else getattr(v, kind)


def _attrs(kvs: Iterator[KeyValue] | Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


@dataclass(frozen=True)
class ReceivedSpan:
    name: str
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root span
    start_ns: int
    end_ns: int
    attrs: dict[str, Any]
    events: tuple[str, ...]
    resource: dict[str, Any]
    error: bool  # status code ERROR


@dataclass
class OtlpReceiver:
    """Start with ``with OtlpReceiver.running() as rx``; ``rx.url`` is the traces URL."""

    url: str = ""
    requests: int = 0  # HTTP requests of any kind received
    spans: list[ReceivedSpan] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: with ``track_peers``: the process that sent each request (read from /proc while its
    #: connection is open: tests/server/procs.py)
    track_peers: bool = False
    peer_pids: list[int | None] = field(default_factory=list)
    #: while clear, a request waits before it is read (a stalled collector); set by default
    open_gate: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.open_gate.set()

    @classmethod
    def running(cls) -> Any:
        import contextlib

        @contextlib.contextmanager
        def run() -> Iterator[OtlpReceiver]:
            rx = cls()
            server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(rx))
            rx.url = f"http://127.0.0.1:{server.server_address[1]}/v1/traces"
            thread = threading.Thread(target=server.serve_forever, name="otlp-rx", daemon=True)
            thread.start()
            try:
                yield rx
            finally:
                server.shutdown()
                server.server_close()
                thread.join(5)

        return run()

    def add(self, body: bytes) -> None:
        req = ExportTraceServiceRequest()
        req.ParseFromString(body)
        out: list[ReceivedSpan] = []
        for rs in req.resource_spans:
            resource = _attrs(rs.resource.attributes)
            for ss in rs.scope_spans:
                for s in ss.spans:
                    out.append(
                        ReceivedSpan(
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_id=s.parent_span_id.hex(),
                            start_ns=s.start_time_unix_nano,
                            end_ns=s.end_time_unix_nano,
                            attrs=_attrs(s.attributes),
                            events=tuple(e.name for e in s.events),
                            resource=resource,
                            error=s.status.code == s.status.STATUS_CODE_ERROR,
                        )
                    )
        with self.lock:
            self.spans.extend(out)

    def wait_for(self, check: Callable[[list[ReceivedSpan]], bool], within: float = 10.0) -> None:
        deadline = time.monotonic() + within * UNIT
        while time.monotonic() < deadline:
            with self.lock:
                if check(list(self.spans)):
                    return
            time.sleep(0.05)
        raise AssertionError(f"the receiver did not get the spans expected: {self.names()}")

    def names(self) -> list[str]:
        with self.lock:
            return [s.name for s in self.spans]


def _handler(rx: OtlpReceiver) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            rx.open_gate.wait()
            pid = pid_of_client(self.client_address[1]) if rx.track_peers else None
            with rx.lock:
                rx.requests += 1
                rx.peer_pids.append(pid)
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            if self.path != "/v1/traces":
                self.send_error(404)
                return
            rx.add(body)
            reply = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler
