"""The Starlette app factory. The lifespan starts the engine in the background (``/health``
answers 503 until every stage has loaded) and stops everything in order on shutdown: stop
accepting sessions, close sockets (1001) with a grace period, cancel the rest, stop the
engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles

from duplex_server import batch
from duplex_server.config import AppConfig
from duplex_server.hub import Hub
from duplex_server.metrics import BatchTiming, Metrics
from duplex_server.realtime import realtime_endpoint
from engine.client import AsyncEngine

log = logging.getLogger(__name__)


class EngineHandle:
    """The app's one engine (the only process-wide state is what this holds)."""

    def __init__(self) -> None:
        self.engine: AsyncEngine | None = None
        self.error: str | None = None

    def get(self) -> AsyncEngine | None:
        return self.engine


def create_app(config: AppConfig) -> Starlette:
    handle = EngineHandle()
    metrics = Metrics(handle.get)
    executor = ThreadPoolExecutor(config.server.vad_threads, thread_name_prefix="input-lane")
    hub = Hub(config, metrics, executor)

    async def start_engine() -> None:
        try:
            handle.engine = await AsyncEngine.start(config.engine)
            hub.sessions.engine = handle.engine
            log.info("engine ready")
        except Exception as exc:  # start-up failure: /health stays 503 and says why
            log.exception("engine failed to start")
            handle.error = f"{type(exc).__name__}: {exc}"

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        starter = asyncio.create_task(start_engine(), name="engine-start")
        try:
            yield
        finally:
            await hub.shutdown(config.server.shutdown_grace_s)
            if not starter.done():
                starter.cancel()
            await asyncio.gather(starter, return_exceptions=True)
            if handle.engine is not None:
                await handle.engine.shutdown()
            executor.shutdown(wait=True, cancel_futures=True)

    async def health(request: Request) -> Response:
        engine = handle.engine
        if engine is not None and engine.ready:
            return JSONResponse({"status": "ok", "sessions": len(hub.sessions)})
        return JSONResponse(
            {"status": "starting" if handle.error is None else "failed", "error": handle.error},
            status_code=503,
        )

    async def metrics_route(request: Request) -> Response:
        metrics.outbound_bytes.set(sum(c.queued_bytes for c in hub.sockets))
        metrics.input_backlog.set(sum(s.lane.backlog for s in hub.sessions.live.values()))
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    routes: list[BaseRoute] = [
        Route("/health", health),
        Route("/metrics", metrics_route),
        WebSocketRoute("/v1/realtime", realtime_endpoint),
        WebSocketRoute("/v1/duplex", realtime_endpoint),
        *batch.routes(handle.get, config.server.batch, config.server.model_name),
    ]
    static = Path(config.server.static_dir)
    if (static / "index.html").is_file():
        routes.append(Mount("/", StaticFiles(directory=static, html=True), name="web"))
    app = Starlette(
        routes=routes, lifespan=lifespan, middleware=[Middleware(BatchTiming, metrics=metrics)]
    )
    app.state.hub = hub
    app.state.engine = handle
    app.state.metrics = metrics
    return app
