"""The supervisor of ``duplex-server serve --workers N``: one engine process and N front ends,
kept running (docs/scale.md, "Deploys and crashes under `serve --workers`").

- A front end that exits (a crash, ``kill -9``, a SIGTERM someone sent it: it drained) is
  started again on the same port and route key after a short backoff (0.25 s, doubling, at
  most 5 s). Its sessions resume on the other front ends meanwhile (the engine holds them).
  One front end exiting ``restart_limit`` times within ``restart_window_s`` makes the
  supervisor give up: one line on stderr, every process stopped, exit status 1.
- The engine process exiting: with ``restart_engine`` (``serve --workers``: its engine keeps
  its sessions in a store, ``engine --state``) it is started again after the same backoff,
  and the same give-up rule holds; the front ends stay up, their clients' sockets open, and
  attach their sessions to the new engine (docs/scale.md, "Sessions outlive the engine").
  Without it, everything stops (exit status 1): a new engine would not know the sessions.
- SIGHUP: a rolling restart. One front end after another: SIGTERM (it drains: its sessions
  are handed over to the others), wait for it to exit, start it again, wait until its
  ``/health`` answers 200, then the next. A SIGHUP during a roll is queued: once the roll
  ends, one more roll runs (any number of SIGHUPs during a roll make one more).
- SIGTERM or SIGINT: a final stop. Every front end gets :data:`FINAL_STOP` at the same
  time: answers in flight finish, then each session is told ``server_shutdown`` (close 1001,
  not resumable: no front end is left to resume on; duplex_server/ops/drain.py); then the
  engine stops; exit status 0.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import FrameType

#: a front end's final stop (``serve --workers`` stopping for good): its sessions cannot live
#: on elsewhere, so they are told so (duplex_server/ops/drain.py ``shut_down``), not handed over
FINAL_STOP = signal.SIGUSR1

_TICK_S = 0.1  # how often the supervisor looks at its processes
_HEALTH_EVERY_S = 0.25


@dataclass(frozen=True)
class Policy:
    restart_limit: int = 5  # exits of one front end within restart_window_s that end it all
    restart_window_s: float = 60.0
    backoff_s: float = 0.25  # before the first restart; doubles with each recent exit
    backoff_max_s: float = 5.0
    stop_timeout_s: float = 30.0  # the longest wait for a front end's drain, then SIGKILL
    ready_timeout_s: float = 120.0  # a restarted front end answers /health 200 by then


class GiveUp(Exception):
    """Stop everything; the message is the one line that says why."""


@dataclass
class FrontEnd:
    """A supervised process: a front end (or, with ``health_url`` empty, the engine)."""

    key: str
    health_url: str
    cmd: list[str]
    label: str = ""  # how the supervisor's lines name it (default: "front end <key>")
    proc: subprocess.Popen[bytes] | None = None
    draining: bool = False  # the supervisor sent SIGTERM (a roll): its exit is expected
    deadline: float = 0.0  # draining: SIGKILL then; being rolled: ready by then
    restart_at: float | None = None  # down after an exit: started again then
    exits: collections.deque[float] = field(default_factory=collections.deque)

    def __post_init__(self) -> None:
        self.label = self.label or f"front end {self.key}"


def describe(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"status {returncode}"


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def say(line: str) -> None:
    print(f"duplex-server: {line}", file=sys.stderr, flush=True)


class Supervisor:
    """``restart_engine``: start the engine again when it exits (it keeps its sessions),
    instead of stopping everything."""

    def __init__(
        self,
        engine_cmd: Sequence[str],
        fronts: Sequence[FrontEnd],
        policy: Policy,
        *,
        restart_engine: bool = False,
    ) -> None:
        self.restart_engine = restart_engine
        self.engine = FrontEnd("engine", "", list(engine_cmd), label="the engine process")
        self.fronts = list(fronts)
        self.policy = policy
        self.stop = False
        self.hup = False
        self.roll: list[FrontEnd] = []  # front ends the running roll has yet to restart
        self.rolling: FrontEnd | None = None  # the one being restarted now
        self.roll_again = False  # a SIGHUP came during a roll
        self._health_at = 0.0

    def run(self) -> int:
        """Start everything and supervise until a signal, a give-up or the engine's exit."""
        handlers = {
            signal.SIGTERM: self._on_stop,
            signal.SIGINT: self._on_stop,
            signal.SIGHUP: self._on_hup,
        }
        old = {s: signal.signal(s, h) for s, h in handlers.items()}
        try:
            self._start(self.engine)
            for front in self.fronts:
                self._start(front)
            pid = os.getpid()
            print(f"supervisor pid {pid}: kill -HUP {pid} restarts the front ends one by one",
                  flush=True)  # fmt: skip
            return self._supervise()
        except GiveUp as exc:
            say(str(exc))
            return 1
        finally:
            self._stop_all()
            for s, h in old.items():
                signal.signal(s, h)

    def _on_stop(self, signum: int, frame: FrameType | None) -> None:
        self.stop = True

    def _on_hup(self, signum: int, frame: FrameType | None) -> None:
        self.hup = True

    def _start(self, front: FrontEnd) -> None:
        # a process group of its own: Ctrl-C in a terminal reaches the supervisor only, which
        # stops its children in order (a final stop, then the engine)
        front.proc = subprocess.Popen(front.cmd, process_group=0)
        front.draining = False
        front.restart_at = None

    def _supervise(self) -> int:
        while not self.stop:
            now = time.monotonic()
            engine = self.engine
            if not self.restart_engine:
                assert engine.proc is not None
                if engine.proc.poll() is not None:
                    raise GiveUp(
                        f"the engine process exited ({describe(engine.proc.returncode)}); "
                        "stopping all (it held every session)"
                    )
            else:
                self._watch(engine, now)
            if self.hup:
                self.hup = False
                self._request_roll()
            for front in self.fronts:
                self._watch(front, now)
            self._roll_step(now)
            time.sleep(_TICK_S)
        return 0

    def _watch(self, front: FrontEnd, now: float) -> None:
        p = self.policy
        if front.proc is None:
            if front.restart_at is not None and now >= front.restart_at:
                self._start(front)
                say(f"{front.label} started again")
            return
        code = front.proc.poll()
        if code is None:
            if front.draining and now > front.deadline:
                say(f"{front.label} still draining after {p.stop_timeout_s:g} s: killed")
                front.proc.kill()
            return
        if front.draining:  # a roll's SIGTERM: start it again at once
            say(f"{front.label} drained ({describe(code)}); starting it again")
            self._start(front)
            return
        front.exits.append(now)
        while front.exits and front.exits[0] < now - p.restart_window_s:
            front.exits.popleft()
        if len(front.exits) >= p.restart_limit:
            raise GiveUp(
                f"{front.label} exited {len(front.exits)} times within "
                f"{p.restart_window_s:g} s (last: {describe(code)}); giving up, stopping all"
            )
        delay = min(p.backoff_s * 2 ** (len(front.exits) - 1), p.backoff_max_s)
        say(f"{front.label} exited ({describe(code)}); restarting it in {delay:g} s")
        front.proc = None
        front.restart_at = now + delay

    def _request_roll(self) -> None:
        if self.rolling is not None or self.roll:
            self.roll_again = True
            say("SIGHUP: a rolling restart is running; another one follows it")
            return
        say("SIGHUP: rolling restart of " + ", ".join(f.key for f in self.fronts))
        self.roll = list(self.fronts)

    def _roll_step(self, now: float) -> None:
        front = self.rolling
        if front is None:
            if not self.roll:
                if self.roll_again:
                    self.roll_again = False
                    say(
                        "rolling restart (queued SIGHUP) of "
                        + ", ".join(f.key for f in self.fronts)
                    )
                    self.roll = list(self.fronts)
                return
            front = self.rolling = self.roll.pop(0)
            front.deadline = now + self.policy.stop_timeout_s
            if front.proc is not None and front.proc.poll() is None:
                front.draining = True
                front.proc.send_signal(signal.SIGTERM)
                say(f"front end {front.key}: SIGTERM (draining)")
            return
        if front.draining or front.proc is None:
            front.deadline = now + self.policy.ready_timeout_s  # counted from its start
            return
        if now < self._health_at:
            return
        self._health_at = now + _HEALTH_EVERY_S
        if healthy(front.health_url):
            say(f"front end {front.key} is back (/health 200)")
            self.rolling = None
            if not self.roll and not self.roll_again:
                say("rolling restart done")
        elif now > front.deadline:
            say(f"front end {front.key} not ready in {self.policy.ready_timeout_s:g} s; "
                "rolling restart stopped")  # fmt: skip
            self.rolling = None
            self.roll = []

    def _stop_all(self) -> None:
        """Every front end stops at once (:data:`~duplex_server.ops.drain.FINAL_STOP`: answers
        in flight finish, then each session is told ``server_shutdown``: no front end is left
        to take it over), then the engine stops."""
        live = [f for f in self.fronts if f.proc is not None and f.proc.poll() is None]
        for front in live:
            if not front.draining:  # one a roll drains already: its sessions go elsewhere
                assert front.proc is not None
                front.proc.send_signal(FINAL_STOP)
        deadline = time.monotonic() + self.policy.stop_timeout_s
        for front in live:
            assert front.proc is not None
            _wait_or_kill(front.proc, deadline)
        engine = self.engine.proc
        if engine is not None:
            if engine.poll() is None:
                engine.send_signal(signal.SIGTERM)
            _wait_or_kill(engine, time.monotonic() + 30)


def _wait_or_kill(proc: subprocess.Popen[bytes], deadline: float) -> None:
    try:
        proc.wait(max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
