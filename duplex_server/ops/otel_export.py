"""Span export in a child process: :class:`ChildExportProcessor`, the span processor of a
traced process (the server, or an engine process), hands each ended span to
``python -m duplex_server.ops.otel_child``, which runs the real OTLP/HTTP exporter.

Why a child: the OTLP exporter builds and serializes its protobuf in Python, ~75 us a span,
holding the GIL; on a thread of the server that stalls the event loop (44 ms wake-ups at
p99 with 100 traced sessions). Here the traced process does only this:

* ``on_end`` (on the thread that ended the span, usually the event loop): a sampled span is
  encoded once as a compact msgpack record (duplex_server.ops.otel_wire, ~4-8 us) and queued;
  when ``max_queue`` spans already wait, it is dropped and counted instead: a slow or stuck
  collector never blocks the loop or grows memory;
* a light thread (``otel-export-send``) wakes every ``export_delay_ms`` (or once
  ``BATCH_SPANS`` wait), joins the queued records into frames and writes them to the child's
  stdin; the write releases the GIL, and blocks only that thread when the child is behind
  (the queue then fills and drops).

The child exits when its stdin closes: at :meth:`shutdown` (which waits for it to export
what it was sent, up to ``SHUTDOWN_S``, then kills it), and also when this process dies
any other way (even ``kill -9``), since its pipe then closes: it never outlives the server.
It ignores SIGINT and SIGTERM so that a Ctrl-C or a group-wide SIGTERM leaves it to export
the spans the server flushes on its way out.

Dropped spans are counted (:attr:`ChildExportProcessor.dropped`, ``duplex_otel_spans``
by outcome in ``/metrics``) and logged: a warning at most every ``DROP_LOG_S`` with the
count since the last one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from duplex_server.ops.otel_wire import Hello, OutBatch, Scope, encode_span, frame, scope_of

log = logging.getLogger(__name__)

#: the most spans in one frame (one OTLP export request in the child)
BATCH_SPANS = 512
#: how long shutdown waits for the child to export what it was sent (then kills it)
SHUTDOWN_S = 10.0
#: the OTLP exporter's timeout per export request in the child (retries included)
EXPORT_TIMEOUT_S = 10.0
#: the least time between two warnings about dropped spans
DROP_LOG_S = 10.0


class ChildExportProcessor(SpanProcessor):
    """Sends the sampled spans that end to an OTLP/HTTP export child (see the module)."""

    def __init__(
        self,
        endpoint: str,
        headers: dict[str, str],
        resource: Resource,
        *,
        export_delay_ms: int = 2000,
        max_queue: int = 4096,
    ) -> None:
        self.max_queue = max_queue
        self.delay_s = export_delay_ms / 1000.0
        self.sent = 0  # spans written to the child
        self.dropped = 0  # spans left out: the queue was full, or the child was gone
        self._queue: list[msgspec.Raw] = []
        self._scopes: dict[InstrumentationScope | None, int] = {}
        self._new_scopes: list[Scope] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._idle = threading.Condition(self._lock)
        self._in_flight = 0  # spans taken off the queue, not yet written
        self._closing = False  # shut down or broken: spans that end now are dropped
        self._broken = False  # the child is gone
        self._shut_down = False
        self._last_warned = 0.0
        self._dropped_warned = 0
        hello = Hello(
            endpoint,
            dict(headers),
            EXPORT_TIMEOUT_S,
            dict(resource.attributes),
            resource.schema_url,
        )
        self.child = subprocess.Popen(
            [sys.executable, "-m", "duplex_server.ops.otel_child"],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            env=_child_env(),
        )
        assert self.child.stdin is not None
        self._pipe = self.child.stdin
        self._thread = threading.Thread(
            target=self._run, args=(frame(hello),), name="otel-export-send", daemon=True
        )
        self._thread.start()

    @property
    def pid(self) -> int:
        return self.child.pid

    # ------------------------------------------------------------- the traced threads
    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        ctx = span.context
        if ctx is None or not ctx.trace_flags.sampled:
            return
        scope = span.instrumentation_scope
        index = self._scopes.get(scope)
        if index is None:
            index = self._add_scope(scope)
        # a full queue or a closed export skips the encoding (checked again under the lock)
        full = self._closing or len(self._queue) >= self.max_queue
        record = None if full else msgspec.Raw(encode_span(span, index))
        with self._lock:
            if record is None or self._closing or len(self._queue) >= self.max_queue:
                self.dropped += 1
                return
            self._queue.append(record)
            if len(self._queue) == BATCH_SPANS:
                self._wake.set()

    def _add_scope(self, scope: InstrumentationScope | None) -> int:
        """``scope``'s index; a new one goes to the child with the next batch."""
        with self._lock:
            index = self._scopes.get(scope)
            if index is None:
                index = self._scopes[scope] = len(self._scopes)
                if scope is not None:
                    self._new_scopes.append(scope_of(index, scope))
            return index

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Write every span queued so far to the child (it exports them on its own time)."""
        deadline = time.monotonic() + timeout_millis / 1000.0
        with self._lock:
            self._wake.set()
            while (self._queue or self._in_flight) and not self._broken:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return False
                self._idle.wait(min(left, 0.05))
                self._wake.set()
        return True

    def shutdown(self) -> None:
        """Send what is queued, close the child's stdin, wait for it to export and exit."""
        with self._lock:
            if self._shut_down:
                return
            self._shut_down = self._closing = True
        self._wake.set()
        deadline = time.monotonic() + SHUTDOWN_S
        self._thread.join(SHUTDOWN_S)
        try:
            self.child.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("otel: the export child did not finish in %.0f s: killed", SHUTDOWN_S)
            self.child.kill()
            self.child.wait()
        self._thread.join()  # a write the kill cut short has returned
        with contextlib.suppress(OSError):
            self._pipe.close()
        self._warn_dropped(force=True)

    # ------------------------------------------------------------------ the sender thread
    def _run(self, hello: bytes) -> None:
        try:
            self._write(hello)
            while True:
                self._wake.wait(self.delay_s)
                self._wake.clear()
                with self._lock:
                    spans, self._queue = self._queue, []
                    scopes, self._new_scopes = self._new_scopes, []
                    self._in_flight = len(spans)
                    closing = self._closing
                for start in range(0, max(len(spans), 1 if scopes else 0), BATCH_SPANS):
                    chunk = spans[start : start + BATCH_SPANS]
                    self._write(frame(OutBatch(scopes if start == 0 else [], chunk)))
                    with self._lock:
                        self.sent += len(chunk)
                        self._in_flight -= len(chunk)
                with self._lock:
                    self._in_flight = 0
                    self._idle.notify_all()
                self._warn_dropped()
                if closing:
                    return
        except OSError as exc:  # the child is gone (killed, or failed to start)
            if not self._shut_down:  # (at shutdown: killed after its time, already said)
                log.error(
                    "otel: the export child (pid %d) is gone (%s): spans are dropped from now on",
                    self.pid,
                    exc,
                )
            with self._lock:
                self._broken = self._closing = True
                self.dropped += len(self._queue) + self._in_flight
                self._queue, self._in_flight = [], 0
                self._idle.notify_all()
        finally:
            with contextlib.suppress(OSError):
                self._pipe.close()  # the child sees the end of its input

    def _write(self, data: bytes) -> None:
        self._pipe.write(data)
        self._pipe.flush()

    def _warn_dropped(self, *, force: bool = False) -> None:
        now = time.monotonic()
        with self._lock:
            new = self.dropped - self._dropped_warned
            if not new or (not force and now - self._last_warned < DROP_LOG_S):
                return
            self._dropped_warned, self._last_warned = self.dropped, now
        log.warning(
            "otel: %d span(s) dropped (the export child is behind or gone; %d in all)",
            new,
            self.dropped,
        )

    def collector(self) -> Collector:
        """``duplex_otel_spans{outcome="sent"|"dropped"}`` for a Prometheus registry."""
        return _SpanCounts(self)


class _SpanCounts(Collector):
    def __init__(self, processor: ChildExportProcessor) -> None:
        self._p = processor

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "duplex_otel_spans",
            "Ended sampled spans by outcome: sent to the OTLP export child, or dropped "
            "(its queue was full: the collector is slow or down)",
            labels=["outcome"],
        )
        family.add_metric(["sent"], self._p.sent)
        family.add_metric(["dropped"], self._p.dropped)
        yield family


def _child_env() -> dict[str, str]:
    """This process's environment, with this copy of ``duplex_server`` first on the child's
    path (the child runs the same code, even from a source tree that is not installed)."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    old = env.get("PYTHONPATH")
    env["PYTHONPATH"] = root if not old else root + os.pathsep + old
    return env
