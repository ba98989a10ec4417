"""The real server as a subprocess on loopback, for the benchmarks (imported by them)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def running_server(
    config: Path, ready_s: float = 180.0, quiet: bool = True
) -> Iterator[tuple[str, int]]:
    """``duplex-server serve`` on 127.0.0.1; yields ``(host:port, pid)`` once /health is 200."""
    port = free_port()
    exe = Path(sys.executable).with_name("duplex-server")
    cmd = [str(exe), "serve", "--config", str(config), "--port", str(port)]
    cmd += ["--log-level", "warning"]
    out = subprocess.DEVNULL if quiet else None
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=out, stderr=out
    )
    addr = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"http://{addr}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            time.sleep(0.2)
        else:
            raise RuntimeError("server did not become ready")
        yield addr, proc.pid
    finally:
        proc.terminate()
        proc.wait(30)
