"""The Starlette app factory. The lifespan starts the engine in the background (``/health``
answers 503 until every stage has loaded) and stops everything in order on shutdown: stop
accepting sessions, close sockets (1001) with a grace period, cancel the rest, stop the
engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import BaseRoute, Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles

from duplex_contract.errors import ConfigError, EngineDeadError
from duplex_contract.voices import VoiceCatalog
from duplex_server.auth import HttpAuth
from duplex_server.config import AppConfig
from duplex_server.http import secrets_route
from duplex_server.http.routes import routes as http_routes
from duplex_server.ops.metrics import BatchTiming, Metrics
from duplex_server.ops.tracing import Tracing
from duplex_server.session.hub import Hub
from duplex_server.transports import live_webrtc, webrtc
from duplex_server.transports.live_socket import live_endpoint
from duplex_server.transports.realtime import realtime_endpoint
from duplex_server.transports.twilio import twilio_endpoint
from engine.api.client import AsyncEngine, EngineClient
from engine.api.remote_client import RemoteEngine
from engine.voices import voices_of

log = logging.getLogger(__name__)


async def attach_engine(addr: str, config: AppConfig, wait_s: float = 900.0) -> RemoteEngine:
    """Connect to an engine process, waiting while it starts (it loads models first)."""
    deadline = time.monotonic() + wait_s
    waited = False
    while True:
        try:
            engine = await RemoteEngine.connect(
                addr, name=f"front-end-{os.getpid()}", restart_s=config.server.engine_restart_s
            )
        except EngineDeadError as exc:
            if time.monotonic() > deadline:
                raise
            # once at INFO: it loads its models for a while, and this loop asks twice a second
            log.log(logging.DEBUG if waited else logging.INFO, "waiting for the engine: %s", exc)
            waited = True
            await asyncio.sleep(0.5)
            continue
        theirs = msgspec.structs.replace(
            engine.config, duplex=msgspec.structs.replace(engine.config.duplex, store_path=None)
        )  # the engine process's own session store is not the front end's business
        if theirs != config.engine:
            log.warning(
                "the engine process at %s runs another engine config than this front end's "
                "(the front end uses its own for VAD and defaults; use one file for both)",
                addr,
            )
        return engine


def speaking_voices(config: AppConfig) -> VoiceCatalog | None:
    """The engine's voices, from its config (engine/voices.py); None, and every voice name
    passed on unchecked, where this process cannot build the engine's stage graph (a front
    end attached to an engine process on a machine without that engine's backends)."""
    try:
        return voices_of(config.engine)
    except ConfigError as exc:
        log.warning("voice names are not checked: the engine's stages are unknown here (%s)", exc)
        return None


async def http_error(request: Request, exc: Exception) -> Response:
    """An unknown route or method: OpenAI's error shape under ``/v1`` (``Invalid URL (GET
    /v1/x)``, code ``unknown_url``, 404; a route's wrong method: 405 naming the ones it takes),
    plain text elsewhere (the browser page's files). Under ``/v1`` the route table decides,
    not the error: the page's static files answer 405 to any POST they cannot serve."""
    assert isinstance(exc, HTTPException)
    path = request.url.path
    if not (path == "/v1" or path.startswith("/v1/")):
        return PlainTextResponse(exc.detail, status_code=exc.status_code, headers=exc.headers)
    allowed = sorted(
        m
        for r in request.app.router.routes
        if isinstance(r, Route) and r.methods and r.path_regex.match(path)
        for m in r.methods
        if m != "HEAD"
    )
    if allowed:
        status, code = 405, "method_not_allowed"
        message = f"{request.method} is not allowed on {path} (allowed: {', '.join(allowed)})"
        headers = {"Allow": ", ".join(allowed)}
    else:
        status, code, headers = 404, "unknown_url", {}
        message = f"Invalid URL ({request.method} {path})"
    body = {
        "error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}
    }
    return JSONResponse(body, status_code=status, headers=headers)


class EngineHandle:
    """The app's one engine (the only process-wide state is what this holds)."""

    def __init__(self) -> None:
        self.engine: EngineClient | None = None
        self.error: str | None = None

    def get(self) -> EngineClient | None:
        return self.engine


def create_app(config: AppConfig, engine_addr: str | None = None) -> Starlette:
    """The app. ``engine_addr``: attach to an engine process (``duplex-server engine``) at
    that address instead of running the engine in this process."""
    handle = EngineHandle()
    metrics = Metrics(handle.get)
    executor = ThreadPoolExecutor(config.server.vad_threads, thread_name_prefix="input-lane")
    voices = speaking_voices(config)
    tracing = Tracing.from_config(config.server.otel)  # None: tracing is off
    if tracing is not None:
        metrics.registry.register(tracing.export.collector())
    hub = Hub(config, metrics, executor, voices, tracing)

    async def start_engine() -> None:
        try:
            if engine_addr is not None:
                engine: EngineClient = await attach_engine(engine_addr, config)
            else:
                tracer = tracing.engine_tracer() if tracing is not None else None
                engine = await AsyncEngine.start(config.engine, tracer=tracer)
            engine.on_dead(lambda exc: setattr(handle, "error", f"engine gone: {exc}"))
            handle.engine = engine
            hub.sessions.engine = engine
            log.info("engine ready")
            if hub.simulated:
                log.warning(
                    "stages %s are simulated (backend sim): they only take the time a GPU "
                    "would, and sessions hear silence (docs/gpu.md, 'Simulated GPU')",
                    ", ".join(hub.simulated),
                )
        except Exception as exc:  # start-up failure: /health stays 503 and says why
            log.exception("engine failed to start")
            handle.error = f"{type(exc).__name__}: {exc}"

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        starter = asyncio.create_task(start_engine(), name="engine-start")
        try:
            yield
        finally:
            log.info("shutting down: closing %d session socket(s)", len(hub.sockets))
            await hub.shutdown(config.server.shutdown_grace_s)
            if not starter.done():
                starter.cancel()
            await asyncio.gather(starter, return_exceptions=True)
            if handle.engine is not None:
                await handle.engine.shutdown()
                log.info("engine %s", "detached" if engine_addr is not None else "stopped")
            executor.shutdown(wait=True, cancel_futures=True)
            if tracing is not None:  # export what is left (a blocking flush)
                await asyncio.to_thread(tracing.shutdown)

    async def health(request: Request) -> Response:
        """200 ``ok``; 200 ``degraded`` naming the replicas down while each stage still has
        a live one (the pool sends their work elsewhere); 503 when a stage has none
        (``unavailable``), while draining, starting, or after a failed start."""
        engine = handle.engine
        stats = engine.stats() if engine is not None and engine.ready else None
        if stats is not None and stats.stages_down:
            down = {
                "status": "unavailable",
                "stages_down": stats.stages_down,
                "replicas_down": stats.replicas_down,
            }
            return JSONResponse(down, status_code=503)
        if hub.draining:  # a load balancer takes this front end out (duplex_server/ops/drain.py)
            body = {"status": "draining", "route_key": config.server.route_key}
            return JSONResponse(body, status_code=503)
        if engine is not None and (stats is not None or engine.restarting):
            # engine_restarting answers 200: every front end waits for the same engine, so a
            # load balancer taking them all out gains nothing (docs/scale.md)
            state: dict[str, object] = {"status": "engine_restarting"}
            if stats is not None:
                state["status"] = "degraded" if stats.replicas_down else "ok"
                if stats.replicas_down:
                    state["replicas_down"] = stats.replicas_down
            state.update(
                sessions=len(hub.sessions),
                sessions_by_state=hub.sessions.by_state(),
                route_key=config.server.route_key,
            )
            if isinstance(engine, RemoteEngine):
                state["engine_id"] = engine.engine_id
            return JSONResponse(state)
        return JSONResponse(
            {"status": "starting" if handle.error is None else "failed", "error": handle.error},
            status_code=503,
        )

    async def metrics_route(request: Request) -> Response:
        outbox = sum(c.queued_bytes for c in hub.sockets)
        metrics.outbound_bytes.set(outbox)
        metrics.input_backlog.set(sum(s.audio.backlog for s in hub.sessions.live.values()))
        for state, n in hub.sessions.by_state().items():
            metrics.sessions.labels(state).set(n)
        for protocol, n in hub.sessions.by_protocol().items():
            metrics.sessions_by_protocol.labels(protocol).set(n)
        engine = handle.engine
        held = {"outbox": outbox, **hub.sessions.held_bytes()}
        if engine is not None and engine.ready:
            held.update(engine.stats().session_bytes)
        for part, n in held.items():
            metrics.session_bytes.labels(part).set(n)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    routes: list[BaseRoute] = [
        Route("/health", health),
        Route("/metrics", metrics_route),
        WebSocketRoute("/v1/realtime", realtime_endpoint),
        WebSocketRoute("/v1/duplex", realtime_endpoint),
        WebSocketRoute("/v1/twilio", twilio_endpoint),
        WebSocketRoute("/v1/live/sessions", live_endpoint),
        *webrtc.routes(hub),
        *live_webrtc.routes(hub, handle.get),
        *secrets_route.routes(hub.secrets, config.server.model_name),
        *http_routes(handle.get, config.server.batch, config.server.model_name, voices),
    ]
    static = Path(config.server.static_dir)
    if (static / "index.html").is_file():
        routes.append(Mount("/", StaticFiles(directory=static, html=True), name="web"))
    s = config.server
    auth = Middleware(
        HttpAuth,
        keys=hub.keys,
        allowed_origins=s.allowed_origins,
        metrics_access=s.metrics_access,
        secrets=hub.secrets,
    )
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={404: http_error, 405: http_error},
        middleware=[auth, Middleware(BatchTiming, metrics=metrics)],
    )
    app.state.hub = hub
    app.state.engine = handle
    app.state.metrics = metrics
    app.state.tracing = tracing
    return app
