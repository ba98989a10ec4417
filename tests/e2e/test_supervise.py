"""`duplex-server serve --workers 2` keeps its front ends running (duplex_server/ops/supervise.py,
docs/scale.md): real processes on 127.0.0.1 behind a real HAProxy, SDK clients, the test
stages. ``kill -9`` of a front end mid-answer: the supervisor starts it again on its port and
route key, its sessions resume on the other front end meanwhile and it takes new sessions
once back. SIGHUP: a rolling restart under 10 sessions mid-answer loses and duplicates
nothing. A front end that dies at once every time makes the supervisor give up (exit 1)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from duplex_client import DuplexClient
from duplex_client import events as ev

from bench.cluster import HAPROXY, health
from bench.serverproc import free_port, free_run
from duplex_server.ops.scale import haproxy_config
from engine.duplex.fencing import route_key_of
from tests.e2e.test_failover import ENGINE, _answer, _until
from tests.server.harness import ROOT, UNIT, write_config

pytestmark = [
    pytest.mark.long,  # make test-long, a CI tier after make test
    pytest.mark.skipif(
        not Path(HAPROXY).exists(),
        reason="needs haproxy (Debian: apt-get install -y haproxy; `make test` installs it)",
    ),
]


def front_pid(sup: int, key: str) -> int | None:
    """The pid of the supervisor's child serving route key ``key`` (from /proc)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == sup and b"serve" in argv and key.encode() in argv:
            return int(entry.name)
    return None


def wait_until(ok: object, within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not ok():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out: {what}")
        time.sleep(0.1)


@dataclass
class Workers:
    sup: subprocess.Popen[bytes]
    fronts: dict[str, str]  # route key -> host:port
    lb: str
    stderr: Path

    def pid(self, key: str) -> int:
        pid = front_pid(self.sup.pid, key)
        assert pid is not None, f"no front end {key}"
        return pid

    def ready(self, key: str, within: float = 60.0) -> None:
        """``key`` answers /health 200 and HAProxy routes to it."""
        addr = self.fronts[key]
        wait_until(lambda: health(addr)[0] == 200, within, f"{key} healthy")
        if self.lb:
            wait_until(lambda: health(self.lb, key)[1].get("route_key") == key, 20, f"lb -> {key}")


@contextlib.contextmanager
def workers(
    tmp: Path,
    *,
    lb: bool = True,
    server: dict[str, object] | None = None,
    config: Path | None = None,
    ready_s: float = 60.0,
) -> Iterator[Workers]:
    """``serve --workers 2`` (and HAProxy in front with ``lb``) on the test stages, or on
    ``config``; ready once both front ends answer /health 200 and HAProxy routes to both."""
    if config is None:
        server = {"drain_s": 10, "drain_health_s": 2.5, **(server or {})}
        config = write_config(tmp, engine=ENGINE, server=server)
    first = free_run(2)
    fronts = {"w1": f"127.0.0.1:{first}", "w2": f"127.0.0.1:{first + 1}"}
    err = tmp / "supervisor.err"
    with err.open("wb") as out:
        sup = subprocess.Popen(
            [sys.executable, "-m", "duplex_server", "serve", "--config", str(config),
             "--port", str(first), "--workers", "2", "--log-level", "warning"],
            cwd=ROOT, stderr=out,
        )  # fmt: skip
    procs = [sup]
    addr = ""
    if lb:
        addr = f"127.0.0.1:{free_port()}"
        cfg = tmp / "haproxy.cfg"
        cfg.write_text(haproxy_config([("127.0.0.1", first), ("127.0.0.1", first + 1)], addr))
        procs.append(
            subprocess.Popen(
                [HAPROXY, "-db", "-f", str(cfg)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
    w = Workers(sup, fronts, addr, err)
    try:
        for key in fronts:
            w.ready(key, ready_s)
        yield w
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(procs):
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


@pytest.fixture(scope="module")
def scaled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workers]:
    with workers(tmp_path_factory.mktemp("supervise")) as w:
        yield w
    assert w.sup.returncode == 0, w.stderr.read_text()  # SIGTERM: all drained, exit 0


async def _open(lb: str, n: int) -> list[DuplexClient]:
    clients = [await DuplexClient.connect(f"ws://{lb}/v1/realtime") for _ in range(n)]

    async def first(client: DuplexClient) -> None:
        await client.update_session({"turn_detection": None})
        assert "alpha" in await _answer(client, "alpha")

    await asyncio.gather(*(first(c) for c in clients))
    assert {route_key_of(c.session_id) for c in clients} == {"w1", "w2"}
    return clients


async def _reply(
    client: DuplexClient, text: str | None, seqs: list[int], *, clean: bool = False
) -> str:
    """Like test_failover's ``_answer`` (``clean``: no ``session.resync_required`` may come),
    recording every event's ``server_event_seq`` in ``seqs``."""
    if text is not None:
        await client.send_text(text)
    parts: dict[str, list[str]] = {}
    while True:
        event = await client.next_event(40 * UNIT)
        assert not (clean and isinstance(event, ev.ResyncRequired)), event
        if event.server_event_seq:
            seqs.append(event.server_event_seq)
        if isinstance(event, ev.TranscriptDelta):
            parts.setdefault(event.response_id, []).append(event.delta)
        if isinstance(event, ev.ResponseDone) and event.response.status == "completed":
            return "".join(parts.get(event.response.id, []))


async def _mid_answer(clients: list[DuplexClient]) -> None:
    async def one(client: DuplexClient) -> None:
        await client.send_text("bravo")
        await _until(client, ev.AudioDelta)

    await asyncio.gather(*(one(c) for c in clients))


def test_kill_9_front_end_is_restarted_and_its_sessions_resume(scaled: Workers) -> None:
    w = scaled
    old = w.pid("w1")

    async def run() -> None:
        clients = await _open(w.lb, 4)
        try:
            ids = [c.session_id for c in clients]
            await _mid_answer(clients)
            victims = [c for c in clients if route_key_of(c.session_id) == "w1"]
            await asyncio.to_thread(lambda: subprocess.run(["kill", "-9", str(old)], check=True))

            async def after(client: DuplexClient) -> None:
                if client in victims:  # resumed on w2 through HAProxy by the SDK
                    await _until(client, ev.ResyncRequired)
                else:
                    assert "bravo" in await _answer(client, None)
                answer = await _answer(client, "charlie")
                assert "alpha" in answer and "charlie" in answer, answer  # conversation intact

            await asyncio.gather(*(after(c) for c in clients))
            assert [c.session_id for c in clients] == ids
            assert all(c.duplicates_dropped == 0 for c in clients)
            assert all(c.resumes == (1 if c in victims else 0) for c in clients)
            # the supervisor started w1 again, on its port and route key
            await asyncio.to_thread(w.ready, "w1")
            assert w.pid("w1") != old and w.sup.poll() is None
            fresh = await DuplexClient.connect(f"ws://{w.lb}/v1/realtime")  # fewest conns: w1
            try:
                assert route_key_of(fresh.session_id) == "w1", fresh.session_id
                await fresh.update_session({"turn_detection": None})
                assert "delta" in await _answer(fresh, "delta")
            finally:
                await fresh.close()
        finally:
            for client in clients:
                await client.close()

    asyncio.run(run())
    assert "front end w1 exited (signal SIGKILL)" in w.stderr.read_text()


def test_sighup_rolls_every_front_end_under_live_sessions(scaled: Workers) -> None:
    w = scaled
    old = {key: w.pid(key) for key in w.fronts}
    start = len(w.stderr.read_text())

    def said(text: str) -> bool:
        return text in w.stderr.read_text()[start:]

    def rolled_twice() -> bool:  # one "done" line, after both rolls
        text = w.stderr.read_text()[start:]
        return "rolling restart done" in text and text.count("is back") == 4

    async def run() -> None:
        clients = await _open(w.lb, 10)
        seqs: dict[str, list[int]] = {c.session_id: [] for c in clients}
        try:
            ids = [c.session_id for c in clients]
            await _mid_answer(clients)
            w.sup.send_signal(signal.SIGHUP)
            await asyncio.to_thread(wait_until, lambda: said("SIGTERM (draining)"), 10, "roll")
            w.sup.send_signal(signal.SIGHUP)  # during the roll: queued, one more roll

            async def bravo(client: DuplexClient) -> None:  # the answer in flight finishes
                reply = await _reply(client, None, seqs[client.session_id], clean=True)
                assert "bravo" in reply

            await asyncio.gather(*(bravo(c) for c in clients))
            await asyncio.to_thread(wait_until, rolled_twice, 120, "two rolls")

            async def charlie(client: DuplexClient) -> None:  # moved, nothing lost
                answer = await _reply(client, "charlie", seqs[client.session_id], clean=True)
                assert "alpha" in answer and "bravo" in answer and "charlie" in answer, answer

            await asyncio.gather(*(charlie(c) for c in clients))
            assert [c.session_id for c in clients] == ids
            assert all(c.duplicates_dropped == 0 for c in clients)
            assert all(c.resumes >= 1 for c in clients), [c.resumes for c in clients]
            for client in clients:  # every event once, in order; the only seqs not shown
                got = seqs[client.session_id]  # are each resume's session.resumed
                assert got == sorted(set(got)), got
                hidden = got[-1] - got[0] + 1 - len(got)
                assert hidden == client.resumes, (hidden, client.resumes, got)
        finally:
            for client in clients:
                await client.close()

    asyncio.run(run())
    for key in w.fronts:
        w.ready(key)
        assert w.pid(key) != old[key]
    assert said("another one follows it") and said("rolling restart (queued SIGHUP)")
    assert w.sup.poll() is None


def test_a_front_end_that_keeps_dying_makes_the_supervisor_give_up(tmp_path: Path) -> None:
    with workers(tmp_path, lb=False, server={"restart_limit": 3, "drain_health_s": 0}) as w:
        host, port = w.fronts["w2"].rsplit(":", 1)
        pid = w.pid("w2")
        with socket.socket() as squatter:
            squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            subprocess.run(["kill", "-9", str(pid)], check=True)
            deadline = time.monotonic() + 10
            while True:  # the port is ours once the process is gone: every restart fails
                try:
                    squatter.bind((host, int(port)))
                    break
                except OSError:
                    assert time.monotonic() < deadline
                    time.sleep(0.005)
            squatter.listen()
            assert w.sup.wait(60) == 1
    lines = [ln for ln in w.stderr.read_text().splitlines() if "giving up" in ln]
    assert lines == [
        "duplex-server: front end w2 exited 3 times within 60 s (last: status 1); "
        "giving up, stopping all"
    ], lines
    assert "already in use" in w.stderr.read_text()  # each restart said why it failed


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_final_stop_tells_every_session_it_ended(tmp_path: Path, sig: signal.Signals) -> None:
    """SIGTERM or SIGINT to ``serve --workers``: no front end is left to resume on, so the answer in
    flight finishes and each session on each front end gets error{server_shutdown},
    session.closed and close 1001 (never the handover and 1012 of a deploy's drain, which
    would send its client resuming on a server that is gone); the supervisor exits 0."""
    import json

    import websockets.sync.client

    with workers(tmp_path, lb=False) as w, contextlib.ExitStack() as stack:
        sockets = [
            stack.enter_context(websockets.sync.client.connect(f"ws://{addr}/v1/realtime"))
            for addr in w.fronts.values()
        ]
        for ws in sockets:
            assert json.loads(ws.recv(timeout=10 * UNIT))["type"] == "session.created"
            item = {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "alpha"}],
            }
            ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
            ws.send(json.dumps({"type": "response.create"}))
            while json.loads(ws.recv(timeout=10 * UNIT))["type"] != "response.output_audio.delta":
                pass
        w.sup.send_signal(sig)
        for ws in sockets:
            events = []
            with pytest.raises(websockets.ConnectionClosed) as closed:
                while True:
                    events.append(json.loads(ws.recv(timeout=30 * UNIT)))
            kinds = [e["type"] for e in events]
            code = closed.value.rcvd.code if closed.value.rcvd is not None else None
            assert code == 1001, (code, kinds)
            assert "session.handover" not in kinds, kinds
            done = [e for e in events if e["type"] == "response.done"]
            assert done and done[0]["response"]["status"] == "completed", kinds
            error = next(e for e in events if e["type"] == "error")["error"]
            assert error["code"] == "server_shutdown", error
            assert events[-1]["type"] == "session.closed", kinds
            assert events[-1]["reason"] == "server_shutdown", events[-1]
        assert w.sup.wait(60) == 0, w.stderr.read_text()
