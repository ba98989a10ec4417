"""Logging set-up of the ``duplex-server`` commands: our own INFO lines, not third-party chatter.

At the default level (``--log-level info``) the server logs what it does (start-up, the engine,
sessions that end, shutdown) and the third-party libraries below log warnings and errors
only: aioice logs every ICE check of every WebRTC call at INFO, faster-whisper every
transcription, httpx every request of the ``openai`` stage. ``--log-level debug`` shows
them all, except each WebSocket frame (the websockets library logs every frame sent and
received, ~700 lines for one short session, nearly all of it audio): those only at
``--log-level trace`` (:class:`FrameFilter`). Health probes (``GET /health`` answered 200,
e.g. HAProxy's checks every second in ``serve-scaled``) are left out of the access log
unless at debug level; a failed probe is still logged.
"""

from __future__ import annotations

import logging

#: third-party loggers held at WARNING unless the level is DEBUG
CHATTY: tuple[str, ...] = (
    "aioice",
    "aiortc",
    "av",
    "faster_whisper",
    "httpx",
    "httpcore",
)

TRACE = 5  # uvicorn's level below DEBUG
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


#: loggers the WebSocket protocol logs its frames to (uvicorn hands it "uvicorn.error")
FRAME_LOGGERS: tuple[str, ...] = ("uvicorn.error", "websockets.server", "websockets.client")


class FrameFilter(logging.Filter):
    """Drops the websockets library's per-frame records (``< BINARY ...``, ``> TEXT ...``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno == logging.DEBUG and record.msg in ("< %s", "> %s"))


class HealthProbeFilter(logging.Filter):
    """Drops uvicorn access-log records of ``GET /health`` answered 200."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not isinstance(args, tuple) or len(args) != 5:
            return True
        _client, method, path, _version, status = args
        return not (method == "GET" and path == "/health" and status == 200)


def level_of(name: str) -> int:
    """``info``, ``DEBUG``, ``warning``, ``trace``... -> the logging level (ValueError if
    unknown). ``trace`` (5, uvicorn's) is debug plus every WebSocket frame."""
    if name.lower() == "trace":
        return TRACE
    level = logging.getLevelName(name.upper())
    if not isinstance(level, int):
        raise ValueError(
            f"unknown log level {name!r} (trace, debug, info, warning, error, critical)"
        )
    return level


def configure(level_name: str) -> int:
    """Set up the root logger at ``level_name`` and quiet the third-party loggers (above);
    returns the level. Call :func:`quiet_access_log` once uvicorn has set up its loggers."""
    level = level_of(level_name)
    logging.basicConfig(level=level, format=FORMAT)
    quiet = logging.WARNING if level > logging.DEBUG else logging.NOTSET
    for name in CHATTY:
        logging.getLogger(name).setLevel(quiet)
    for name in FRAME_LOGGERS:
        logger = logging.getLogger(name)
        for f in [f for f in logger.filters if isinstance(f, FrameFilter)]:
            logger.removeFilter(f)
        if level >= logging.DEBUG:  # frames only at trace (5)
            logger.addFilter(FrameFilter())
    return level


def quiet_access_log(level: int) -> None:
    """Leave successful health probes out of uvicorn's access log (unless at DEBUG)."""
    access = logging.getLogger("uvicorn.access")
    for f in [f for f in access.filters if isinstance(f, HealthProbeFilter)]:
        access.removeFilter(f)
    if level > logging.DEBUG:
        access.addFilter(HealthProbeFilter())
