"""An engine process, front ends started one by one (route keys w1..wN) and HAProxy on
loopback, for the failover test and benchmark: a front end can be killed (``kill -9``),
drained (SIGTERM) and started again on its port while the others serve (:class:`Cluster`);
or ``serve --workers N`` behind HAProxy, whose engine can be killed and comes back
(:class:`Supervised`)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from bench.serverproc import ROOT, free_port, free_run, server_env
from duplex_server.ops.scale import haproxy_config

HAPROXY = shutil.which("haproxy") or "/usr/sbin/haproxy"


def health(addr: str, route: str | None = None) -> tuple[int, dict[str, object]]:
    """``/health`` of ``addr`` (``route``: through HAProxy to that front end): status, body."""
    url = f"http://{addr}/health" + (f"?route={route}" if route else "")
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, {}
    except OSError:
        return 0, {}


class Cluster:
    """``lb``: the address clients use; ``fronts``: route key -> ``host:port``."""

    def __init__(self, config: Path, fronts: int, ready_s: float) -> None:
        self.config = config
        self.ready_s = ready_s
        self.tmp = Path(tempfile.mkdtemp(prefix="duplex-cluster-"))
        self.engine_addr = f"unix://{self.tmp}/engine.sock"
        self.fronts = {f"w{i + 1}": f"127.0.0.1:{free_port()}" for i in range(fronts)}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.lb = f"127.0.0.1:{free_port()}"
        self.exe = str(Path(sys.executable).with_name("duplex-server"))
        self.logs: dict[str, Path] = {}

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        log = self.tmp / f"{name}.log"
        self.logs[name] = log
        with log.open("ab") as out:
            proc = subprocess.Popen(args, cwd=ROOT, env=server_env(), stdout=out, stderr=out)
        self.procs[name] = proc
        return proc

    def start(self) -> None:
        self._spawn(
            "engine",
            [self.exe, "engine", "--config", str(self.config), "--listen", self.engine_addr,
             "--log-level", "warning"],
        )  # fmt: skip
        for key in self.fronts:
            self.start_front(key, wait=False)
        for key in self.fronts:
            self.wait_front(key)
        hosts = [(a.rsplit(":", 1)[0], int(a.rsplit(":", 1)[1])) for a in self.fronts.values()]
        cfg = self.tmp / "haproxy.cfg"
        cfg.write_text(haproxy_config(hosts, self.lb, keys=list(self.fronts)))
        self.procs["haproxy"] = subprocess.Popen(
            [HAPROXY, "-db", "-f", str(cfg)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        for key in self.fronts:
            self.wait_routed(key)

    def start_front(self, key: str, *, wait: bool = True) -> None:
        port = self.fronts[key].rsplit(":", 1)[1]
        self._spawn(
            key,
            [self.exe, "serve", "--config", str(self.config), "--port", port,
             "--engine", self.engine_addr, "--route-key", key, "--log-level", "info"],
        )  # fmt: skip
        if wait:
            self.wait_front(key)

    def wait_front(self, key: str) -> None:
        deadline = time.monotonic() + self.ready_s
        while health(self.fronts[key])[0] != 200:
            proc = self.procs[key]
            if proc.poll() is not None:
                raise RuntimeError(f"front end {key} exited with {proc.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"front end {key} did not become ready")
            time.sleep(0.1)

    def wait_routed(self, key: str, within: float = 20.0) -> None:
        """HAProxy sends requests for ``key`` to that front end (its checks saw it up)."""
        deadline = time.monotonic() + within
        while health(self.lb, key)[1].get("route_key") != key:
            if time.monotonic() > deadline:
                raise RuntimeError(f"HAProxy does not route to {key}")
            time.sleep(0.1)

    def kill(self, key: str) -> None:
        """``kill -9``: the front end dies with its sessions mid-whatever."""
        proc = self.procs[key]
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    def drain(self, key: str, timeout_s: float = 60.0) -> float:
        """SIGTERM: the front end drains and exits; returns how long that took (s)."""
        proc = self.procs[key]
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout_s)
        return time.monotonic() - start

    def stop(self) -> None:
        for name in ("haproxy", *self.fronts, "engine"):
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGINT if name != "haproxy" else signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        shutil.rmtree(self.tmp, ignore_errors=True)


@contextlib.contextmanager
def cluster(config: Path, fronts: int = 2, ready_s: float = 120.0) -> Iterator[Cluster]:
    c = Cluster(config, fronts, ready_s)
    try:
        c.start()
        yield c
    finally:
        c.stop()


def child_pid(parent: int, *needles: bytes) -> int | None:
    """The pid of ``parent``'s child whose argv holds every one of ``needles`` (/proc)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == parent and all(n in argv for n in needles):
            return int(entry.name)
    return None


class Supervised:
    """``duplex-server serve --workers N`` (one engine process that keeps its sessions, N
    front ends, the supervisor) and HAProxy in front: ``lb`` is the clients' address,
    ``fronts`` route key -> ``host:port``; the engine can be killed (``kill -9``) and the
    supervisor starts it again."""

    def __init__(self, config: Path, fronts: int, ready_s: float) -> None:
        self.config = config
        self.ready_s = ready_s
        self.tmp = Path(tempfile.mkdtemp(prefix="duplex-supervised-"))
        first = free_run(fronts)
        self.fronts = {f"w{i + 1}": f"127.0.0.1:{first + i}" for i in range(fronts)}
        self.first_port = first
        self.lb = f"127.0.0.1:{free_port()}"
        self.exe = str(Path(sys.executable).with_name("duplex-server"))
        self.log = self.tmp / "supervisor.log"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.procs["supervisor"] = subprocess.Popen(
                [self.exe, "serve", "--config", str(self.config), "--port", str(self.first_port),
                 "--workers", str(len(self.fronts)), "--log-level", "warning"],
                cwd=ROOT, env=server_env(), stdout=out, stderr=out,
            )  # fmt: skip
        deadline = time.monotonic() + self.ready_s
        for addr in self.fronts.values():
            while health(addr)[0] != 200:
                if self.procs["supervisor"].poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"serve --workers did not come up: {self.log.read_text()}")
                time.sleep(0.1)
        hosts = [(a.rsplit(":", 1)[0], int(a.rsplit(":", 1)[1])) for a in self.fronts.values()]
        cfg = self.tmp / "haproxy.cfg"
        cfg.write_text(haproxy_config(hosts, self.lb, keys=list(self.fronts)))
        self.procs["haproxy"] = subprocess.Popen(
            [HAPROXY, "-db", "-f", str(cfg)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        for key in self.fronts:
            deadline = time.monotonic() + 20
            while health(self.lb, key)[1].get("route_key") != key:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"HAProxy does not route to {key}")
                time.sleep(0.1)

    def engine_pid(self) -> int:
        pid = child_pid(self.procs["supervisor"].pid, b"engine", b"--listen")
        if pid is None:
            raise RuntimeError("no engine process")
        return pid

    def kill_engine(self) -> int:
        """``kill -9`` of the engine process; returns its pid."""
        pid = self.engine_pid()
        os.kill(pid, signal.SIGKILL)
        return pid

    def stop(self) -> None:
        keep = os.environ.get("DUPLEX_BENCH_LOGS")  # a folder to copy the log to
        for name in ("haproxy", "supervisor"):
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        if keep:
            shutil.copy(self.log, Path(keep) / "supervisor.log")
        shutil.rmtree(self.tmp, ignore_errors=True)


@contextlib.contextmanager
def supervised(config: Path, fronts: int = 2, ready_s: float = 120.0) -> Iterator[Supervised]:
    s = Supervised(config, fronts, ready_s)
    try:
        s.start()
        yield s
    finally:
        s.stop()
