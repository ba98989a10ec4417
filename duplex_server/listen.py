"""The listening socket of ``duplex-server serve``, bound before anything else starts.

``serve`` binds its port first and hands the socket to uvicorn, so a port that is taken
fails at once with one clear line, before the engine loads a model (uvicorn binds only
after the app's start-up); and no other program can take the port while the models load.
"""

from __future__ import annotations

import errno
import socket


class ListenError(Exception):
    """The address cannot be listened on; the message says why and what to do."""


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (as uvicorn binds it: ``SO_REUSEADDR``, IPv6 for
    a host with a colon), not yet listening. Raises :class:`ListenError`."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    where = f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ListenError(
                f"cannot listen on {where}: the port is already in use (another server "
                "running? stop it, or choose another port with --port / PORT=)"
            ) from None
        if exc.errno == errno.EACCES:
            raise ListenError(
                f"cannot listen on {where}: permission denied (ports below 1024 need "
                "privileges; choose another with --port / PORT=)"
            ) from None
        raise ListenError(f"cannot listen on {where}: {exc.strerror or exc}") from None
    except OverflowError:  # a port outside 0-65535
        sock.close()
        raise ListenError(f"cannot listen on {where}: ports are 0-65535") from None
    sock.set_inheritable(True)
    return sock


def bound_url(sock: socket.socket) -> str:
    """``http://host:port`` of a bound socket (the real port when 0 was asked for)."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if sock.family == socket.AF_INET6 else f"http://{host}:{port}"
