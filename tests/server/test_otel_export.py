"""Span export in a child process (duplex_server.ops.otel_export, docs/protocol.md §13): the
records the traced process pipes over rebuild the very spans (the same OTLP protobuf); the
export's HTTP requests come from the child, not from a thread of the server; a stalled
collector makes spans drop, counted, instead of blocking whoever ends them; shutdown
flushes; the child never outlives the process that started it."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

import msgspec
import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, SpanProcessor, TracerProvider
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    set_span_in_context,
)
from opentelemetry.trace.span import TraceState
from opentelemetry.util.types import AttributeValue

from duplex_server.config import OtelConfig
from duplex_server.ops.otel_wire import (
    Batch,
    Hello,
    Message,
    OutBatch,
    encode_span,
    frame,
    instrumentation_scope,
    readable_span,
    resource_of,
    scope_of,
)
from duplex_server.ops.tracing import Tracing
from tests.server.harness import UNIT, running_server, write_config
from tests.server.otlp_receiver import OtlpReceiver
from tests.server.procs import gone
from tests.server.test_tracing import otel, text_session

REPO = Path(__file__).resolve().parents[2]


class _Keep(SpanProcessor):
    def __init__(self) -> None:
        self.spans: list[ReadableSpan] = []

    def on_end(self, span: ReadableSpan) -> None:
        self.spans.append(span)


def test_a_span_rebuilt_from_its_record_encodes_to_the_same_otlp_protobuf() -> None:
    resource = Resource.create({"service.name": "dx", "duplex.process": "server"})
    keep = _Keep()
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(keep)
    tracer = provider.get_tracer("duplex_server", "1.2", schema_url="https://x/1.0")
    remote = SpanContext(
        0xABC << 64 | 0xDEF, 0x1234, True, TraceFlags(1), TraceState([("vendor", "v1")])
    )
    linked = SpanContext(0xFFFF_FFFF_FFFF_FFFF_FFFF_FFFF_FFFF_FFFF, 0x99, False, TraceFlags(1))
    attrs: dict[str, AttributeValue] = {
        "s": "x",
        "b": True,
        "i": -(2**63),
        "f": 0.25,
        "l": ("a", "b"),
        "n": (1, 2),
    }
    root = tracer.start_span(
        "turn",
        context=set_span_in_context(NonRecordingSpan(remote)),
        kind=SpanKind.SERVER,
        attributes=attrs,
        links=[Link(linked, {"why": "resumed"})],
    )
    root.add_event("barge_in", {"duplex.response_id": "resp_1"}, timestamp=123)
    root.set_status(Status(StatusCode.ERROR, "EngineError: gone"))
    root.end()
    child = tracer.start_span("engine.llm", context=set_span_in_context(root))
    child.end()
    local = provider.get_tracer("engine").start_span("bare")
    local.set_status(Status(StatusCode.OK))
    local.end()
    # a provider whose limits drop attributes, events and links: the counts survive too
    limits = SpanLimits(
        max_span_attributes=2, max_events=1, max_links=1, max_event_attributes=1,
        max_link_attributes=1,
    )  # fmt: skip
    small = TracerProvider(resource=resource, span_limits=limits)
    small.add_span_processor(keep)
    links = [Link(linked, {"a": 1, "b": 2}), Link(remote)]
    over = small.get_tracer("duplex_server", "1.2", schema_url="https://x/1.0").start_span(
        "over", attributes=attrs, links=links
    )
    for i in range(3):
        over.add_event(f"e{i}", {"x": i, "y": i}, timestamp=1000 + i)
    over.end()
    assert len(keep.spans) == 4
    assert (over.dropped_attributes, over.dropped_events, over.dropped_links) == (4, 2, 1)  # type: ignore[attr-defined]

    # the traced side: records and scopes, framed; the child's side: decoded, rebuilt
    scopes: dict[object, int] = {}
    records, new_scopes = [], []
    for span in keep.spans:
        scope = span.instrumentation_scope
        assert scope is not None
        if scope not in scopes:
            scopes[scope] = len(scopes)
            new_scopes.append(scope_of(scopes[scope], scope))
        records.append(msgspec.Raw(encode_span(span, scopes[scope])))
    hello = Hello("http://c:4318/v1/traces", {"k": "v"}, 1.0, dict(resource.attributes), "")
    decoder = msgspec.msgpack.Decoder(Message)
    got_hello = decoder.decode(frame(hello)[4:])
    batch = decoder.decode(frame(OutBatch(new_scopes, records))[4:])
    assert isinstance(got_hello, Hello) and isinstance(batch, Batch)
    rebuilt_scopes = {s.index: instrumentation_scope(s) for s in batch.scopes}
    rebuilt = [readable_span(r, resource_of(got_hello), rebuilt_scopes) for r in batch.spans]

    want = encode_spans(keep.spans).SerializeToString(deterministic=True)
    assert encode_spans(rebuilt).SerializeToString(deterministic=True) == want
    assert rebuilt[0].parent is not None and rebuilt[0].parent.is_remote
    assert rebuilt[0].context is not None and rebuilt[0].context.trace_state == remote.trace_state


def test_the_server_exports_from_a_child_process_not_from_its_own_threads(
    tmp_path: Path,
) -> None:
    with OtlpReceiver.running() as rx:
        rx.track_peers = True
        path = write_config(tmp_path, server=otel(rx.url))
        apps: list[object] = []
        with running_server(path, apps=apps) as addr:
            sid = asyncio.run(text_session(addr))
            rx.wait_for(lambda spans: any(s.name == "session" for s in spans))
            tracing = apps[0].state.tracing  # type: ignore[attr-defined]
            assert isinstance(tracing, Tracing)
            child = tracing.export.pid
            assert child != os.getpid() and tracing.export.child.poll() is None
            # every export request came over a connection the child holds
            with rx.lock:
                senders = set(rx.peer_pids)
            assert senders == {child}, (senders, child, os.getpid())
            # and no exporting thread runs here: only the light sender
            names = {t.name for t in threading.enumerate()}
            assert "otel-export-send" in names
            assert not any(n.startswith("OtelBatch") for n in names), names
            with urllib.request.urlopen(f"http://{addr}/metrics", timeout=5 * UNIT) as r:
                text = r.read().decode()
            assert 'duplex_otel_spans_total{outcome="dropped"} 0.0' in text
            sent = [
                ln for ln in text.splitlines() if 'duplex_otel_spans_total{outcome="sent"' in ln
            ]
            assert sent and float(sent[0].split()[-1]) >= 3, sent
        # stopped: the child exported what was left and exited
        assert tracing.export.child.returncode == 0
    assert any(s.attrs.get("duplex.session_id") == sid for s in rx.spans)


def test_a_stalled_collector_drops_spans_and_never_blocks_the_caller(
    caplog: pytest.LogCaptureFixture,
) -> None:
    total = 3000
    with OtlpReceiver.running() as rx:
        rx.open_gate.clear()  # the collector takes the connection and does not answer
        tracing = Tracing(OtelConfig(endpoint=rx.url, export_delay_ms=5, max_queue=50))
        try:
            slowest = 0.0
            started = time.perf_counter()
            for i in range(total):
                span = tracing.tracer.start_span("work", attributes={"i": i, "pad": "x" * 200})
                t0 = time.perf_counter()
                span.end()
                slowest = max(slowest, time.perf_counter() - t0)
                if i % 100 == 0:
                    time.sleep(0.002)  # let the sender fill the pipe while the child is stuck
            took = time.perf_counter() - started
            dropped = tracing.export.dropped
            # the child is stuck in its first export, the pipe and the queue are full
            assert dropped > 0
            assert slowest < 0.1 * UNIT and took < 5 * UNIT, (slowest, took)
        finally:
            rx.open_gate.set()
            with caplog.at_level(logging.WARNING, logger="duplex_server.ops.otel_export"):
                tracing.shutdown()
        # every span not counted as dropped reached the collector, each once
        got = sorted(s.attrs["i"] for s in rx.spans)
    assert len(got) == total - dropped == tracing.export.sent
    assert len(set(got)) == len(got)
    assert tracing.export.child.returncode == 0
    assert any("span(s) dropped" in r.getMessage() for r in caplog.records)


def test_shutdown_flushes_every_span_and_the_child_exits() -> None:
    with OtlpReceiver.running() as rx:
        tracing = Tracing(OtelConfig(endpoint=rx.url, export_delay_ms=60_000))
        for i in range(700):  # more than a frame's worth, long before the export delay
            tracing.tracer.start_span("s", attributes={"i": i}).end()
        tracing.shutdown()  # no waiting: the spans are at the collector when it returns
        assert sorted(s.attrs["i"] for s in rx.spans) == list(range(700))
        assert tracing.export.child.returncode == 0 and tracing.export.dropped == 0
        tracing.shutdown()  # twice is harmless


def test_a_killed_child_makes_spans_drop_without_an_error_for_the_caller(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with OtlpReceiver.running() as rx:
        tracing = Tracing(OtelConfig(endpoint=rx.url, export_delay_ms=5))
        tracing.export.child.kill()
        # dead (its pipe closed), but not reaped: the shutdown must do that
        os.waitid(os.P_PID, tracing.export.pid, os.WEXITED | os.WNOWAIT)
        with caplog.at_level(logging.WARNING, logger="duplex_server.ops.otel_export"):
            for i in range(20):
                tracing.tracer.start_span("s", attributes={"i": i}).end()
                time.sleep(0.01)
            tracing.shutdown()
    assert tracing.export.dropped == 20 and tracing.export.sent == 0
    assert tracing.export.child.returncode == -signal.SIGKILL  # reaped by the shutdown
    assert any("is gone" in r.getMessage() for r in caplog.records)


def test_the_child_exits_when_the_traced_process_is_killed() -> None:
    with OtlpReceiver.running() as rx:
        script = textwrap.dedent(
            f"""
            import time
            from duplex_server.config import OtelConfig
            from duplex_server.ops.tracing import Tracing
            t = Tracing(OtelConfig(endpoint={rx.url!r}, export_delay_ms=5))
            t.tracer.start_span("before-the-kill").end()
            print(t.export.pid, flush=True)
            time.sleep(120)
            """
        )
        cmd = [sys.executable, "-c", script]
        with subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True) as proc:
            try:
                assert proc.stdout is not None
                child = int(proc.stdout.readline())
                rx.wait_for(lambda spans: [s.name for s in spans] == ["before-the-kill"])
                assert not gone(child)
            finally:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
        deadline = time.monotonic() + 10 * UNIT
        while not gone(child):
            assert time.monotonic() < deadline, f"the export child {child} outlived its parent"
            time.sleep(0.05)
