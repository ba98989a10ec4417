"""Prometheus metrics on a per-app registry (no process-global collectors).

Engine-side numbers (sessions by state, admissions, stale chunks dropped in the engine,
queue depths, per-stage latency) are read from ``EngineClient.stats()`` at scrape time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from duplex_server.protocol.events import Usage
from engine.api.client import EngineClient, EngineStats

_FAST = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)
_SLOW = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)


def _by_outcome(name: str, doc: str, counts: dict[str, int]) -> CounterMetricFamily:
    """A counter family with one sample per ``outcome`` label."""
    family = CounterMetricFamily(name, doc, labels=["outcome"])
    for outcome, n in counts.items():
        family.add_metric([outcome], n)
    return family


def _stage_families(stats: EngineStats) -> Iterator[Metric]:
    """Restarts of every stage; what the stages' own engines (vLLM) report."""
    restarts = CounterMetricFamily(
        "duplex_stage_restarts",
        "Restarts of a stage's replicas (a dead worker thread or vLLM EngineCore), all "
        "attempts counted",
        labels=["stage"],
    )
    for stage, n in stats.stage_restarts.items():
        restarts.add_metric([stage], n)
    yield restarts
    engines = stats.stage_engines
    gauges = (
        (
            "duplex_stage_running_requests",
            "Requests in the running batch of a stage's engine (vLLM's scheduler), all replicas",
            "running",
        ),
        (
            "duplex_stage_waiting_requests",
            "Requests waiting in a stage engine's scheduler (vLLM), all replicas",
            "waiting",
        ),
        (
            "duplex_stage_kv_cache_usage_ratio",
            "KV cache in use, 0-1, of the fullest replica of a stage (vLLM)",
            "kv_cache_usage",
        ),
        (
            "duplex_stage_tokens_per_second",
            "Tokens a stage's engine generated per second "
            "over the last 5 s, all replicas (vLLM: the thinker's text, the talker's codec "
            "tokens)",
            "tokens_per_s",
        ),
    )
    for name, doc, attr in gauges:
        family = GaugeMetricFamily(name, doc, labels=["stage"])
        for stage, fig in engines.items():
            family.add_metric([stage], float(getattr(fig, attr)))
        yield family
    busy = CounterMetricFamily(
        "duplex_stage_busy_seconds",
        "Device time a stage's calls and steps took, all replicas (the simulated GPU's stages)",
        labels=["stage"],
    )
    for stage, fig in engines.items():
        busy.add_metric([stage], fig.busy_s)
    yield busy
    tokens = CounterMetricFamily(
        "duplex_stage_tokens",
        "Tokens a stage's engine processed, by kind: prompt (prefilled), generated",
        labels=["stage", "kind"],
    )
    for stage, fig in engines.items():
        tokens.add_metric([stage, "prompt"], fig.prompt_tokens)
        tokens.add_metric([stage, "generated"], fig.generated_tokens)
    yield tokens


def _scheduling_families(stats: EngineStats) -> Iterator[Metric]:
    """The scheduling policy per stage (engine/orchestration/scheduling.py)."""
    sched = stats.scheduling
    gauges = (
        ("capacity", "Request slots of a stage (replicas x batch, or the config's)"),
        ("limit", "Slots a stage admits to: its capacity, or fewer by its real-time budget"),
        ("reserve", "Slots of a stage that batch work, guesses and drafts leave free"),
        ("realtime_waiting", "Real-time requests of a stage before their first output"),
        ("batch_waiting", "Batch requests waiting to be admitted to a stage"),
        (
            "pace",
            "A stage's real-time budget: the rate its live streams get over the rate real "
            "time needs, slowest replica (below 1: behind; 0: not known)",
        ),
    )
    for attr, doc in gauges:
        family = GaugeMetricFamily(f"duplex_scheduler_{attr}", doc, labels=["stage"])
        for stage, fig in sched.items():
            family.add_metric([stage], float(getattr(fig, attr)))  # (a field named above)
        yield family
    in_flight = GaugeMetricFamily(
        "duplex_scheduler_in_flight",
        "Requests in flight in a stage by kind: realtime, draft, speculative, batch",
        labels=["stage", "kind"],
    )
    admissions = CounterMetricFamily(
        "duplex_scheduler_batch_admissions",
        "Batch requests of a stage by how they were admitted: waited (had to wait for "
        "room), aged (let in by the minimum share after engine.scheduling.batch_age_s), "
        "timed_out (refused with server_busy after batch_wait_s)",
        labels=["stage", "outcome"],
    )
    yielded = CounterMetricFamily(
        "duplex_scheduler_drafts_yielded",
        "Drafts asked to leave a stage for a real-time request",
        labels=["stage"],
    )
    outputs = CounterMetricFamily(
        "duplex_stage_outputs",
        "Outputs of a stage (tokens, frames, audio chunks, transcripts) by use: realtime, "
        "draft_used (of drafts their turn adopted), draft_wasted (of drafts thrown away), "
        "speculative (pause guesses), batch",
        labels=["stage", "use"],
    )
    waits = HistogramMetricFamily(
        "duplex_scheduler_batch_wait_seconds",
        "How long a batch request waited to be admitted to a stage",
        labels=["stage"],
    )
    for stage, fig in sched.items():
        for kind, n in fig.in_flight.items():
            in_flight.add_metric([stage, kind], n)
        admissions.add_metric([stage, "waited"], fig.batch_waits)
        admissions.add_metric([stage, "aged"], fig.batch_aged)
        admissions.add_metric([stage, "timed_out"], fig.batch_timeouts)
        yielded.add_metric([stage], fig.drafts_yielded)
        for use, n in fig.outputs.items():
            outputs.add_metric([stage, use], n)
        if len(fig.wait_buckets) == len(fig.wait_bounds) + 1:
            total, buckets = 0, []
            bounds = (*map(str, fig.wait_bounds), "+Inf")
            for bound, n in zip(bounds, fig.wait_buckets, strict=True):
                total += n
                buckets.append((bound, float(total)))
            waits.add_metric([stage], buckets, fig.wait_sum_s)
    yield from (in_flight, admissions, yielded, outputs, waits)


class _EngineCollector(Collector):
    def __init__(self, engine: Callable[[], EngineClient | None]) -> None:
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        engine = self._engine()
        if engine is None or not engine.ready:
            return
        stats = engine.stats()
        sessions = GaugeMetricFamily(
            "duplex_engine_sessions", "Engine sessions by state", labels=["state"]
        )
        for state, n in stats.sessions.items():
            sessions.add_metric([state], n)
        yield sessions
        yield _by_outcome("duplex_admissions", "Session admissions by outcome", stats.admissions)
        stale = CounterMetricFamily(
            "duplex_engine_stale_chunks_dropped", "Stale output dropped by the orchestrator"
        )
        stale.add_metric([], stats.stale_chunks_dropped)
        yield stale
        yield _by_outcome(
            "duplex_speculative_responses",
            "Speculative responses (answers to a pause, held until the commit) by outcome: "
            "started, used (a turn adopted it), dropped (never sent)",
            stats.speculative_responses,
        )
        yield _by_outcome(
            "duplex_speculative_transcripts",
            "Speculative transcripts of a pause in the user's speech by outcome: started, "
            "skipped (another session's turn was running), used (the commit took it), "
            "reguessed (made again: sound the VAD did not call speech followed the pause)",
            stats.speculative_transcripts,
        )
        yield from _stage_families(stats)
        yield from _scheduling_families(stats)
        depth = GaugeMetricFamily("duplex_engine_queue_depth", "Engine queues", labels=["queue"])
        depth.add_metric(["request"], stats.request_queue_depth)
        depth.add_metric(["output"], stats.output_queue_depth)
        depth.add_metric(["pending_calls"], stats.pending_calls)
        yield depth


class Metrics:
    def __init__(self, engine: Callable[[], EngineClient | None]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._engine = engine
        r = self.registry
        self.connections = Gauge("duplex_connections", "Sockets by state", ["state"], registry=r)
        self.connection_outcomes = Counter(
            "duplex_connection_outcomes", "Handshake outcomes", ["outcome"], registry=r
        )
        self.ttfa = Histogram(
            "duplex_time_to_first_audio_seconds",
            "Commit (end of user turn) -> first audio delta written",
            buckets=_SLOW,
            registry=r,
        )
        self.turn_segment = Histogram(
            "duplex_turn_segment_seconds",
            "Where a spoken turn's time to first audio goes, per segment (response.done "
            "timing: silence_wait, asr, llm, tts, send, server_total)",
            ["segment"],
            buckets=_SLOW,
            registry=r,
        )
        self.bargein = Histogram(
            "duplex_bargein_stop_seconds",
            "Barge-in trigger -> response.done{cancelled} written",
            buckets=_FAST,
            registry=r,
        )
        self.chunk_overhead = Histogram(
            "duplex_chunk_overhead_seconds",
            "Engine audio chunk received by the server -> its frame written to the socket "
            "(on the realtime WebSocket: handed to it; one loop iteration's writes go out "
            "together at its end)",
            buckets=_FAST,
            registry=r,
        )
        self.sessions_taken_over = Counter(
            "duplex_sessions_taken_over",
            "Sessions resumed here from another front end (crash: events may be lost; "
            "handover: drained cleanly)",
            ["how"],
            registry=r,
        )
        self.stale_dropped = Counter(
            "duplex_stale_chunks_dropped",
            "Stale audio dropped by the server",
            ["where"],
            registry=r,
        )
        self.stage_latency = Histogram(
            "duplex_stage_latency_seconds",
            "Per-stage request latency",
            ["stage"],
            buckets=_SLOW,
            registry=r,
        )
        self.stage_batch = Histogram(
            "duplex_stage_batch_size",
            "Requests advanced together by one step of a batching stage",
            ["stage"],
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
            registry=r,
        )
        self.stage_wait = Histogram(
            "duplex_stage_queue_wait_seconds",
            "Per-stage wait of a request from its submit to the start of its work (a worker "
            "picked it up, its first batch step, or vLLM's scheduler queue time)",
            ["stage"],
            buckets=(*_FAST, 2.0, 5.0),
            registry=r,
        )
        self.stage_decode = Histogram(
            "duplex_stage_decode_seconds_per_audio_second",
            "Decoder seconds per second of audio of one decoder step (the codec; < 1 is "
            "faster than real time)",
            ["stage"],
            buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0),
            registry=r,
        )
        self.outbound_bytes = Gauge(
            "duplex_outbound_queue_bytes", "Bytes queued to all sockets", registry=r
        )
        self.input_backlog = Gauge(
            "duplex_input_backlog_bytes", "Unprocessed input audio bytes", registry=r
        )
        self.sessions = Gauge(
            "duplex_sessions",
            "Live sessions in the front end by state (attached, detached, closing)",
            ["state"],
            registry=r,
        )
        self.sessions_by_protocol = Gauge(
            "duplex_sessions_by_protocol",
            "Live sessions in the front end by wire protocol (realtime: /v1/realtime, WebRTC "
            "calls and Twilio; live: GPT-Live's /v1/live/sessions)",
            ["protocol"],
            registry=r,
        )
        self.session_bytes = Gauge(
            "duplex_session_bytes",
            "Bytes held for live sessions by part, all sessions summed",
            ["part"],
            registry=r,
        )
        self.errors = Counter("duplex_errors", "Wire errors sent", ["code"], registry=r)
        self.usage_tokens = Counter(
            "duplex_usage_tokens",
            "Tokens of finished responses by kind (response.done usage, docs/protocol.md "
            "§5.11): input_text, input_audio, input_cached, output_text, output_audio",
            ["kind"],
            registry=r,
        )
        self.usage_audio = Counter(
            "duplex_usage_audio_seconds",
            "Audio by kind: input (received by sessions), output (spoken by responses)",
            ["kind"],
            registry=r,
        )
        #: the input child, looked up once: it is counted for every frame of every session
        self._audio_in = self.usage_audio.labels("input")
        self.batch_latency = Histogram(
            "duplex_batch_request_seconds",
            "Batch HTTP request latency, to the last byte of the response",
            ["route", "status"],
            buckets=_SLOW,
            registry=r,
        )
        r.register(_EngineCollector(engine))

    def count_usage(self, usage: Usage) -> None:
        """A response finished: its tokens and spoken audio."""
        i, o = usage.input_token_details, usage.output_token_details
        for kind, n in (
            ("input_text", i.text_tokens),
            ("input_audio", i.audio_tokens),
            ("input_cached", i.cached_tokens),
            ("output_text", o.text_tokens),
            ("output_audio", o.audio_tokens),
        ):
            self.usage_tokens.labels(kind).inc(n)
        self.usage_audio.labels("output").inc(usage.output_audio_seconds)

    def count_audio_in(self, ms: float) -> None:
        """A session received ``ms`` of input audio."""
        self._audio_in.inc(ms / 1000.0)

    def render(self) -> bytes:
        engine = self._engine()
        if engine is not None:
            for stage, seconds in engine.drain_stage_latencies():
                self.stage_latency.labels(stage).observe(seconds)
            for stage, size in engine.drain_stage_steps():
                self.stage_batch.labels(stage).observe(size)
            for stage, seconds in engine.drain_stage_waits():
                self.stage_wait.labels(stage).observe(seconds)
            for stage, busy, audio in engine.drain_stage_decodes():
                self.stage_decode.labels(stage).observe(busy / audio)
        return generate_latest(self.registry)


BATCH_ROUTES = ("/v1/audio/speech", "/v1/audio/transcriptions", "/v1/chat/completions")


class BatchTiming:
    """ASGI middleware: times the batch routes to the end of their (streamed) response."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path not in BATCH_ROUTES:
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def timed_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, timed_send)
        finally:
            self.metrics.batch_latency.labels(path, str(status)).observe(
                time.perf_counter() - start
            )
