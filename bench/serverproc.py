"""The real server as a subprocess on loopback, for the benchmarks (imported by them)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_run(n: int) -> int:
    """A free port P with P+1 .. P+n-1 also free (``serve --workers n`` listens on them,
    and exits with 1 if one is taken: a loopback client's ephemeral port can be)."""
    for _ in range(50):
        port = free_port()
        try:
            for i in range(1, n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + i))
        except OSError:
            continue
        return port
    raise RuntimeError(f"no {n} free ports in a row")


def server_env() -> dict[str, str]:
    """The environment of a server subprocess: offline, and importing this checkout's code
    (whatever checkout the virtual environment was installed from)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": path}


def wait_healthy(proc: subprocess.Popen[bytes], addrs: list[str], deadline: float) -> None:
    """Wait until every address answers /health with 200 (the process must stay up)."""
    for addr in addrs:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"http://{addr}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{addr} did not become ready")
            time.sleep(0.2)


@contextlib.contextmanager
def running_server(
    config: Path,
    ready_s: float = 180.0,
    quiet: bool = True,
    log: IO[bytes] | None = None,
    log_level: str = "warning",
) -> Iterator[tuple[str, int]]:
    """``duplex-server serve`` on 127.0.0.1; yields ``(host:port, pid)`` once /health is 200.
    ``log``: a file that gets the server's output (else it is discarded, or shown if not
    ``quiet``) at ``log_level``."""
    port = free_port()
    exe = Path(sys.executable).with_name("duplex-server")
    cmd = [str(exe), "serve", "--config", str(config), "--port", str(port)]
    cmd += ["--log-level", log_level]
    out: IO[bytes] | int | None = log if log is not None else subprocess.DEVNULL if quiet else None
    proc = subprocess.Popen(cmd, cwd=ROOT, env=server_env(), stdout=out, stderr=out)
    addr = f"127.0.0.1:{port}"
    try:
        wait_healthy(proc, [addr], time.monotonic() + ready_s)
        yield addr, proc.pid
    finally:
        proc.terminate()
        proc.wait(30)


def children(pid: int) -> list[int]:
    """Direct child processes of ``pid`` (Linux /proc)."""
    out: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            out += [int(c) for c in (task / "children").read_text().split()]
    return out


@contextlib.contextmanager
def running_scaled(
    config: Path, workers: int, via_lb: bool, ready_s: float = 120.0
) -> Iterator[tuple[list[str], list[str], list[int]]]:
    """``duplex-server serve --workers N`` (engine process + N front ends), and HAProxy in
    front when ``via_lb``. Yields (addresses clients connect to, front-end addresses,
    server pids: the engine's and the front ends')."""
    first = free_run(workers)
    exe = Path(sys.executable).with_name("duplex-server")
    cmd = [str(exe), "serve", "--config", str(config), "--port", str(first)]
    cmd += ["--workers", str(workers), "--log-level", "warning"]
    env = server_env()
    sup = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    fronts = [f"127.0.0.1:{first + i}" for i in range(workers)]
    procs = [sup]
    try:
        wait_healthy(sup, fronts, time.monotonic() + ready_s)
        targets = fronts
        if via_lb:
            from duplex_server.ops.scale import haproxy_config

            lb_port = free_port()
            cfg = Path(tempfile.mkdtemp(prefix="duplex-lb-")) / "haproxy.cfg"
            hosts = [(a.rsplit(":", 1)[0], int(a.rsplit(":", 1)[1])) for a in fronts]
            cfg.write_text(haproxy_config(hosts, f"127.0.0.1:{lb_port}"))
            procs.append(subprocess.Popen(["haproxy", "-db", "-f", str(cfg)]))
            targets = [f"127.0.0.1:{lb_port}"]
            time.sleep(1.5)  # HAProxy's first health checks
        yield targets, fronts, children(sup.pid)
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            p.wait(30)
