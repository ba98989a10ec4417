"""`duplex-server serve` run as a user runs it, in its own process group, for tests that look
at its exit, its children and its log."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from tests.server.harness import ROOT, UNIT, http_status

SERVE = [sys.executable, "-m", "duplex_server", "serve"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def health(addr: str) -> int | None:
    """``GET /health``'s status, None while nothing listens."""
    try:
        return http_status(addr, "/health")
    except OSError:
        return None


def group_members(pgid: int) -> list[tuple[int, str]]:
    """``(pid, command line)`` of the live processes in process group ``pgid``."""
    out: list[tuple[int, str]] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # state, ppid, pgrp, ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append((int(entry.name), cmdline))
    return out


@contextlib.contextmanager
def serve(config: Path, port: int, log: Path, *extra: str) -> Iterator[subprocess.Popen[bytes]]:
    """``duplex-server serve`` in its own process group (as a shell runs it), output to
    ``log``; killed with its group if the test fails."""
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*SERVE, "--config", str(config), "--port", str(port), *extra],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def wait_healthy(proc: subprocess.Popen[bytes], addr: str, log: Path, within: float) -> None:
    """Until ``/health`` answers 200 (the models loaded); fails if the server exits."""
    deadline = time.monotonic() + within * UNIT
    while health(addr) != 200:
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)
