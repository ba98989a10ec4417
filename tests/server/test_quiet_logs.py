"""At the default log level the server logs its own lines, not third-party chatter: a WebRTC
call leaves no aioice INFO line, health probes leave no access-log line; ``--log-level
debug`` shows both."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import aioice.ice
import pytest

from tests.server.cli_server import free_port, health, serve, wait_healthy
from tests.server.harness import ROOT, TEST_YAML, UNIT
from tests.server.webrtc_client import RtcClient


async def _call(addr: str) -> None:
    client = RtcClient()
    try:
        assert (await client.connect(addr)).status_code == 201
        await client.until("session.created", within=10)
        assert await client.hangup(addr) == 200
    finally:
        await client.close()


def _log_of_a_call(tmp: Path, *extra: str) -> str:
    port, log = free_port(), tmp / f"server{len(extra)}.log"
    with serve(TEST_YAML, port, log, *extra) as proc:
        addr = f"127.0.0.1:{port}"
        wait_healthy(proc, addr, log, 60)
        asyncio.run(_call(addr))
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(30 * UNIT) == 0, log.read_text()
    return log.read_text()


def test_a_webrtc_call_logs_no_third_party_info_at_the_default_level(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # this process calls from loopback too, as the server offers only 127.0.0.1 (test.yaml)
    monkeypatch.setattr(aioice.ice, "get_host_addresses", lambda use_ipv4, use_ipv6: ["127.0.0.1"])
    quiet = _log_of_a_call(tmp_path)
    assert "listening on http://" in quiet and "engine ready" in quiet  # our own INFO lines
    assert '"POST /v1/realtime/calls HTTP/1.1" 201' in quiet  # requests are still logged
    assert "aioice" not in quiet, quiet
    assert '"GET /health HTTP/1.1" 200' not in quiet, quiet
    loud = _log_of_a_call(tmp_path, "--log-level", "debug")
    assert "INFO aioice.ice: " in loud  # the chatter exists; the default level hides it
    assert '"GET /health HTTP/1.1" 200' in loud


HAPROXY = shutil.which("haproxy") or "/usr/sbin/haproxy"


@pytest.mark.skipif(not Path(HAPROXY).exists(), reason="needs haproxy (`make test` installs it)")
def test_serve_scaled_starts_and_runs_without_alerts_or_health_check_lines(
    tmp_path: Path,
) -> None:
    port = free_port()
    while any(health(f"127.0.0.1:{port + i}") is not None for i in (1, 2)):
        port = free_port()  # HAProxy on port, front ends on port+1 and port+2
    log = tmp_path / "scaled.log"
    env = {**os.environ, "CONFIG": str(TEST_YAML), "PORT": str(port), "WORKERS": "2"}
    env["BIN"] = str(Path(sys.executable).parent)
    with log.open("wb") as out:
        proc = subprocess.Popen(
            ["bash", "deploy/serve-scaled.sh"],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_healthy(proc, f"127.0.0.1:{port}", log, 120)  # through HAProxy
        time.sleep(3 * UNIT)  # HAProxy checks each front end every second
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(60 * UNIT)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    text = log.read_text()
    assert "HAProxy on http://" in text, text
    assert "[ALERT]" not in text and "no server available" not in text, text
    # HAProxy's checks, every second per front end (a probe answered 503 while the models
    # load, by the script's wait, is still logged)
    assert '"GET /health HTTP/1.1" 200' not in text, text
    assert text.count("waiting for the engine") <= 2, text  # once per front end at most
