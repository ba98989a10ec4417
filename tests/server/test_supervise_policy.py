"""The supervisor's rules (duplex_server/ops/supervise.py) with small stand-in processes instead
of the engine and front ends, so each case takes a second or two: a front end that exits is
started again with a growing backoff and the supervisor gives up after ``restart_limit``
exits in the window; the engine exiting stops everything; SIGTERM stops the front ends
before the engine; SIGHUP restarts the front ends one after another, each only once the
previous one answers /health, and a SIGHUP during a roll makes one more roll.
(tests/e2e/test_supervise.py does the same with the real server behind HAProxy.)"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from bench.serverproc import free_port
from duplex_server.ops.supervise import FrontEnd, Policy, Supervisor

# a stand-in process: logs "start NAME" to LOG (and "term NAME" on SIGTERM, "final NAME" on
# SIGUSR1, the supervisor's final stop of a front end, then exits 0.3 s later); with a port it
# answers every HTTP GET with 200 (its /health), else it sleeps; CODE >= 0: it exits with it
# once LOG has AFTER "start" lines (the others' handlers are set)
STAND_IN = r"""
import http.server, os, signal, sys, time
name, log, port, code = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
after = int(sys.argv[5])
while after and open(log).read().count("start") < after:
    time.sleep(0.01)
def note(what):
    with open(log, "a") as f:
        f.write(f"{what} {name}\n")
def term(signum, frame):  # a drain takes a moment (a 2nd SIGTERM meanwhile: a 2nd line)
    note("term")
    time.sleep(0.3)
    os._exit(0)
def final(signum, frame):
    note("final")
    time.sleep(0.3)
    os._exit(0)
signal.signal(signal.SIGTERM, term)
signal.signal(signal.SIGUSR1, final)
if code >= 0:
    raise SystemExit(code)
class Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
server = http.server.HTTPServer(("127.0.0.1", port), Ok) if port else None
note("start")
if server is not None:
    server.serve_forever()
time.sleep(600)
"""


def stand_in(name: str, log: Path, port: int = 0, exit_code: int = -1, after: int = 0) -> list[str]:
    log.touch()
    return [sys.executable, "-c", STAND_IN, name, str(log), str(port), str(exit_code), str(after)]


def front(key: str, log: Path, port: int = 0, exit_code: int = -1, after: int = 0) -> FrontEnd:
    cmd = stand_in(key, log, port, exit_code, after)
    return FrontEnd(key, f"http://127.0.0.1:{port}/health", cmd)


def lines(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def later(condition: Callable[[], bool], action: Callable[[], None], within: float = 20) -> None:
    """Once ``condition`` holds (checked from a thread), ``action``; fails the wait loudly."""

    def run() -> None:
        deadline = time.monotonic() + within
        while not condition():
            if time.monotonic() > deadline:
                os.kill(os.getpid(), signal.SIGTERM)  # ends the supervisor: the test fails
                return
            time.sleep(0.02)
        action()

    threading.Thread(target=run, daemon=True).start()


def signal_me(sig: int) -> Callable[[], None]:
    return lambda: os.kill(os.getpid(), sig)


def test_a_front_end_that_exits_is_restarted_then_the_supervisor_gives_up(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "log"
    fronts = [front("w1", log), front("w2", log, exit_code=3, after=2)]  # engine, w1
    policy = Policy(restart_limit=3, restart_window_s=60, backoff_s=0.1)
    start = time.monotonic()
    timer = threading.Timer(20.0, signal_me(signal.SIGTERM))  # never gave up: 0, not 1
    timer.start()
    try:
        assert Supervisor(stand_in("engine", log), fronts, policy).run() == 1
    finally:
        timer.cancel()
    assert time.monotonic() - start < 20
    err = capsys.readouterr().err.splitlines()
    assert err.count("duplex-server: front end w2 exited (status 3); restarting it in 0.1 s") == 1
    assert err.count("duplex-server: front end w2 exited (status 3); restarting it in 0.2 s") == 1
    assert err[-1] == (
        "duplex-server: front end w2 exited 3 times within 60 s (last: status 3); "
        "giving up, stopping all"
    )
    assert sum("giving up" in line for line in err) == 1
    # w1 (healthy) was stopped (a final stop) before the engine
    assert lines(log).index("final w1") < lines(log).index("term engine"), lines(log)


def test_exits_outside_the_window_do_not_add_up(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "log"
    fronts = [front("w1", log, exit_code=0)]
    policy = Policy(restart_limit=2, restart_window_s=0.05, backoff_s=0.1)
    timer = threading.Timer(4.0, signal_me(signal.SIGTERM))
    timer.start()
    try:
        assert Supervisor(stand_in("engine", log), fronts, policy).run() == 0  # never gave up
    finally:
        timer.cancel()
    err = capsys.readouterr().err
    assert err.count("front end w1 exited (status 0); restarting it in 0.1 s") >= 3, err
    assert "giving up" not in err


def test_the_engine_exiting_stops_everything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "log"
    fronts = [front("w1", log), front("w2", log)]
    engine = stand_in("engine", log, exit_code=7, after=2)  # w1, w2
    assert Supervisor(engine, fronts, Policy()).run() == 1
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == (
        "duplex-server: the engine process exited (status 7); stopping all (it held every session)"
    )
    assert sorted(x for x in lines(log) if x.startswith(("term", "final"))) == [
        "final w1",
        "final w2",
    ]


def test_sigterm_stops_the_front_ends_for_good_then_the_engine(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "log"
    fronts = [front("w1", log), front("w2", log)]
    later(lambda: len(lines(log)) == 3, signal_me(signal.SIGTERM))
    assert Supervisor(stand_in("engine", log), fronts, Policy()).run() == 0
    got = lines(log)
    assert sorted(got[3:5]) == ["final w1", "final w2"] and got[5:] == ["term engine"], got


def test_sighup_restarts_the_front_ends_one_after_another(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "log"
    fronts = [front("w1", log, free_port()), front("w2", log, free_port())]
    sup = Supervisor(stand_in("engine", log), fronts, Policy())

    def rolled_twice() -> bool:
        idle = sup.rolling is None and not sup.roll and not sup.roll_again
        return idle and lines(log).count("start w2") == 3

    later(lambda: len(lines(log)) == 3, signal_me(signal.SIGHUP))
    later(lambda: "term w1" in lines(log), signal_me(signal.SIGHUP))  # during the roll
    later(rolled_twice, signal_me(signal.SIGTERM), within=30)
    assert sup.run() == 0
    got = [x for x in lines(log) if x != "start engine"]
    # two rolls: each front end stopped, started, and only then the next one stopped
    roll = ["term w1", "start w1", "term w2", "start w2"]
    assert got[:2] == ["start w1", "start w2"] or got[:2] == ["start w2", "start w1"], got
    assert got[2:10] == roll + roll, got
    text = capsys.readouterr().err
    assert "SIGHUP: a rolling restart is running; another one follows it" in text
    assert text.count("rolling restart done") == 1
    assert text.count("is back (/health 200)") == 4


def test_sigterm_during_a_roll_does_not_signal_the_draining_front_end_twice(
    tmp_path: Path,
) -> None:
    log = tmp_path / "log"
    fronts = [front("w1", log, free_port()), front("w2", log, free_port())]
    later(lambda: len(lines(log)) == 3, signal_me(signal.SIGHUP))
    later(lambda: "term w1" in lines(log), signal_me(signal.SIGTERM))  # w1 is draining
    assert Supervisor(stand_in("engine", log), fronts, Policy()).run() == 0
    got = lines(log)
    assert got.count("term w1") == 1 and "final w1" not in got, got  # its drain goes on
    assert got.count("final w2") == 1 and "term w2" not in got, got
    assert got[-1] == "term engine" and "start w1" not in got[3:], got
