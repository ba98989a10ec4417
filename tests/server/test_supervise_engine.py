"""The supervisor's rules for the engine process under ``serve --workers`` (it keeps its
sessions in a store: duplex_server/ops/supervise.py ``restart_engine``), with stand-in
processes: an engine that exits is started again after the front ends' backoff while the
front ends stay up; one that keeps exiting makes the supervisor give up by the same rule
(``restart_limit`` exits within ``restart_window_s``)."""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path

import pytest

from duplex_server.ops.supervise import Policy, Supervisor
from tests.server.test_supervise_policy import front, later, lines, signal_me, stand_in

# an engine that exits with status 7 the first time it runs, then stays up
ONCE = r"""
import os, sys, time
log, marker = sys.argv[1], sys.argv[2]
with open(log, "a") as f:
    f.write("start engine\n")
if not os.path.exists(marker):
    open(marker, "w").close()
    raise SystemExit(7)
time.sleep(600)
"""


def test_an_engine_that_exits_is_started_again_and_the_front_ends_stay(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "log"
    log.touch()
    fronts = [front("w1", log), front("w2", log)]
    engine = [sys.executable, "-c", ONCE, str(log), str(tmp_path / "ran")]
    later(lambda: lines(log).count("start engine") == 2, signal_me(signal.SIGTERM))
    sup = Supervisor(engine, fronts, Policy(backoff_s=0.1), restart_engine=True)
    assert sup.run() == 0
    err = capsys.readouterr().err
    assert "the engine process exited (status 7); restarting it in 0.1 s" in err, err
    assert "the engine process started again" in err
    got = lines(log)
    assert got.count("start w1") == got.count("start w2") == 1, got  # never restarted
    assert got.index("final w1") > got.index("start engine", 1)  # stopped only at the end


def test_an_engine_that_keeps_exiting_makes_the_supervisor_give_up(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "log"
    fronts = [front("w1", log), front("w2", log)]
    engine = stand_in("engine", log, exit_code=7, after=2)  # w1, w2 are up first
    policy = Policy(restart_limit=3, restart_window_s=60, backoff_s=0.1)
    timer = threading.Timer(20.0, signal_me(signal.SIGTERM))  # never gave up: 0, not 1
    timer.start()
    try:
        assert Supervisor(engine, fronts, policy, restart_engine=True).run() == 1
    finally:
        timer.cancel()
    err = capsys.readouterr().err.splitlines()
    assert "duplex-server: the engine process exited (status 7); restarting it in 0.1 s" in err
    assert "duplex-server: the engine process exited (status 7); restarting it in 0.2 s" in err
    assert err[-1] == (
        "duplex-server: the engine process exited 3 times within 60 s (last: status 7); "
        "giving up, stopping all"
    )
    assert err.count("duplex-server: the engine process started again") == 2  # 3 runs
    got = lines(log)  # (an exiting stand-in logs no start)
    assert got.count("start w1") == got.count("start w2") == 1, got
    assert sorted(x for x in got if x.startswith(("term", "final"))) == ["final w1", "final w2"]
