"""`duplex-server serve --workers 2` (one engine process, two front ends) behind a real
HAProxy (Debian's package; `make test` installs it) on 127.0.0.1: new sessions spread over
both front ends, dropped sockets resume through HAProxy on the owning front end with nothing
lost or duplicated, and a forged resume on another front end is refused."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.serverproc import free_run
from duplex_server.ops.scale import haproxy_config
from engine.duplex.fencing import route_key_of
from tests.e2e.test_engine_process import _status, free_port, wait_for
from tests.server.harness import REALTIME_TTS, ROOT, Client, http_text, text_item, write_config

HAPROXY = shutil.which("haproxy") or "/usr/sbin/haproxy"
pytestmark = pytest.mark.skipif(
    not Path(HAPROXY).exists(),
    reason="needs haproxy (Debian: apt-get install -y haproxy; `make test` installs it)",
)


@contextlib.contextmanager
def scaled(tmp: Path) -> Iterator[str]:
    config = write_config(tmp, engine=REALTIME_TTS)
    first = free_run(2)  # (serve --workers 2 listens on it and the next)
    second = first + 1
    lb_port = free_port()
    (tmp / "haproxy.cfg").write_text(
        haproxy_config([("127.0.0.1", first), ("127.0.0.1", second)], f"127.0.0.1:{lb_port}")
    )
    sup = subprocess.Popen(
        [sys.executable, "-m", "duplex_server", "serve", "--config", str(config),
         "--port", str(first), "--workers", "2", "--log-level", "warning"],
        cwd=ROOT,
    )  # fmt: skip
    proxy = subprocess.Popen([HAPROXY, "-db", "-f", str(tmp / "haproxy.cfg")])
    try:
        for port in (first, second):
            wait_for(lambda p=port: _status(f"127.0.0.1:{p}") == 200, 60, f"front end {port}")
        lb = f"127.0.0.1:{lb_port}"
        for key in ("w1", "w2"):  # HAProxy has seen both front ends up
            wait_for(lambda k=key: route_seen(lb, k), 20, f"haproxy routing to {key}")
        yield f"127.0.0.1:{lb_port}"
    finally:
        for p in (proxy, sup):
            p.send_signal(signal.SIGTERM)
        for p in (proxy, sup):
            try:
                p.wait(40)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        assert sup.returncode == 0, sup.returncode


def route_seen(lb: str, key: str) -> bool:
    try:
        body = http_text(lb, f"/health?route={key}")
    except OSError:
        return False
    return bool(json.loads(body).get("route_key") == key)


async def resume(lb: str, sid: str, token: str, seq: int, route: str) -> Client:
    cm = Client.connect(lb, f"?intent=resume&route={route}")
    client: Client = await cm.__aenter__()
    client._cm = cm  # type: ignore[attr-defined]
    await client.send(
        {
            "type": "session.resume",
            "session_id": sid,
            "resume_token": token,
            "last_received_server_event_seq": seq,
        }
    )
    return client


def test_sessions_spread_over_front_ends_and_resume_through_haproxy(tmp_path: Path) -> None:
    with scaled(tmp_path) as lb:

        async def run() -> None:
            async with contextlib.AsyncExitStack() as stack:
                clients = [await stack.enter_async_context(Client.connect(lb)) for _ in range(20)]
                created = [await c.until("session.created") for c in clients]
                keys = [route_key_of(e["session"]["id"]) for e in created]
                assert set(keys) == {"w1", "w2"}
                assert min(keys.count("w1"), keys.count("w2")) >= 5, keys  # least connections
                # four sessions (two per front end) drop mid-reply and resume via HAProxy
                picks = [keys.index("w1"), keys.index("w2")]
                picks += [keys.index("w1", picks[0] + 1), keys.index("w2", picks[1] + 1)]
                for i in picks:
                    await clients[i].send(text_item("talk"))
                    await clients[i].send({"type": "response.create"})
                for i in picks:
                    await clients[i].until("response.output_audio.delta", within=10)
                    clients[i].ws.transport.abort()
                await asyncio.sleep(0.2)
                for n, i in enumerate(picks):
                    sid = created[i]["session"]["id"]
                    token = created[i]["resume_token"]
                    first = clients[i].events
                    seq = first[-1]["server_event_seq"]
                    key = keys[i]
                    assert key is not None
                    if n == 0:  # a forged resume on the other front end: refused there
                        # (the right token on another front end takes the session over:
                        # route keys are an optimization, tests/e2e/test_failover.py)
                        other = "w2" if key == "w1" else "w1"
                        forged = await resume(lb, sid, "forged-token", seq, other)
                        err = await forged.until("error")
                        assert err["error"]["code"] == "invalid_resume_token", err
                        await forged._cm.__aexit__(None, None, None)  # type: ignore[attr-defined]
                    b = await resume(lb, sid, token, seq, key)
                    try:
                        await b.until("response.done", within=20)
                        everything: list[dict[str, Any]] = first + b.events
                        seqs = [e["server_event_seq"] for e in everything]
                        assert seqs == list(range(1, len(seqs) + 1))  # 0 lost, 0 duplicated
                        assert everything[-1]["response"]["status"] == "completed"
                    finally:
                        await b._cm.__aexit__(None, None, None)  # type: ignore[attr-defined]

        asyncio.run(run())


def test_the_sdk_resumes_through_haproxy_on_the_owning_front_end(tmp_path: Path) -> None:
    from duplex_client import DuplexClient
    from duplex_client import events as ev

    from tests.client.test_sdk import _until

    with scaled(tmp_path) as lb:

        async def run() -> None:
            clients = [await DuplexClient.connect(f"ws://{lb}/v1/realtime") for _ in range(4)]
            try:
                for client in clients:  # session.created told each where to resume
                    key = route_key_of(client.session_id)
                    assert client.resume_query == f"intent=resume&route={key}"
                for client in clients:
                    await client.update_session({"turn_detection": None})
                    await _until(client, ev.SessionUpdated)
                    await client.send_text("hi")
                    await _until(client, ev.AudioDelta)
                    client.connection._ws.transport.abort()  # type: ignore[union-attr]  # abrupt drop
                for client in clients:
                    done, _ = await _until(client, ev.ResponseDone, 20)
                    assert done.response.status == "completed"
                    assert client.resumes == 1
            finally:
                for client in clients:
                    await client.close()

        asyncio.run(run())
