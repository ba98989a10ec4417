"""Logging set-up of the ``duplex-server`` commands: our own INFO lines, not third-party chatter.

At the default level (``--log-level info``) the server logs what it does (start-up, the engine,
sessions that end, shutdown) and the third-party libraries below log warnings and errors
only: aioice logs every ICE check of every WebRTC call at INFO, faster-whisper every
transcription, httpx every request of the ``openai`` stage. ``--log-level debug`` shows
them all. Health probes (``GET /health`` answered 200, e.g. HAProxy's checks every second
in ``serve-scaled``) are left out of the access log unless at debug level; a failed probe is
still logged.
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

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class HealthProbeFilter(logging.Filter):
    """Drops uvicorn access-log records of ``GET /health`` answered 200."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not isinstance(args, tuple) or len(args) != 5:
            return True
        _client, method, path, _version, status = args
        return not (method == "GET" and path == "/health" and status == 200)


def level_of(name: str) -> int:
    """``info``, ``DEBUG``, ``warning``... -> the logging level (ValueError if unknown)."""
    level = logging.getLevelName(name.upper())
    if not isinstance(level, int):
        raise ValueError(f"unknown log level {name!r} (debug, info, warning, error, critical)")
    return level


def configure(level_name: str) -> int:
    """Set up the root logger at ``level_name`` and quiet the third-party loggers (above);
    returns the level. Call :func:`quiet_access_log` once uvicorn has set up its loggers."""
    level = level_of(level_name)
    logging.basicConfig(level=level, format=FORMAT)
    quiet = logging.WARNING if level > logging.DEBUG else logging.NOTSET
    for name in CHATTY:
        logging.getLogger(name).setLevel(quiet)
    return level


def quiet_access_log(level: int) -> None:
    """Leave successful health probes out of uvicorn's access log (unless at DEBUG)."""
    access = logging.getLogger("uvicorn.access")
    for f in [f for f in access.filters if isinstance(f, HealthProbeFilter)]:
        access.removeFilter(f)
    if level > logging.DEBUG:
        access.addFilter(HealthProbeFilter())
