"""Which process is which, from Linux's /proc: the owner of a TCP client connection, and
whether a process has ended (tests of the OTLP export child)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def _inodes_of_local_port(port: int) -> set[str]:
    """The socket inodes of the TCP connections whose local port is ``port``."""
    out: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port:
                    out.add(fields[9])
    return out


def pid_of_client(port: int) -> int | None:
    """The process holding the TCP connection whose local (client) port is ``port``."""
    inodes = {f"socket:[{i}]" for i in _inodes_of_local_port(port) if i != "0"}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (proc / "fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd) in inodes:
                        return int(proc.name)
    return None


def gone(pid: int) -> bool:
    """The process has exited (no longer listed, or a zombie waiting for its reaper)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"
