"""``duplex-server serve --config PATH --host H --port P``."""

from __future__ import annotations

import argparse
import logging
import sys

import uvicorn

from duplex_server.app import create_app
from duplex_server.config import load_app_config
from engine.errors import ConfigError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="duplex-server")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the server")
    serve.add_argument("--config", default="configs/cpu.yaml")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = load_app_config(args.config)
    except ConfigError as exc:
        print(f"duplex-server: bad config: {exc}", file=sys.stderr)
        return 2
    app = create_app(config)
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        ws_max_size=config.server.max_frame_bytes + 1024 * 1024,
        ws_ping_interval=20.0,
        ws_ping_timeout=20.0,
        ws_per_message_deflate=config.server.ws_per_message_deflate,
        timeout_graceful_shutdown=int(config.server.shutdown_grace_s) + 1,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
