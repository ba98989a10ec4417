"""`duplex-server serve` as a user runs it: Ctrl-C and SIGTERM to the whole process group stop
the server, the engine and the partials child cleanly (no traceback, no ERROR, no process
left); a port that is taken fails at once, before any model loads."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import soxr
import websockets.sync.client
import yaml

from tests.server.cli_server import SERVE, free_port, group_members, serve, wait_healthy
from tests.server.harness import ROOT, TEST_YAML, UNIT


def beckett_24k(seconds: float) -> bytes:
    data, rate = sf.read(ROOT / "tests" / "data" / "beckett.wav", dtype="float32")
    if data.ndim > 1:
        data = data.mean(axis=1)
    data = soxr.resample(data[: int(rate * seconds)], rate, 24000)
    return (np.clip(data, -1, 1) * 32767).astype("<i2").tobytes()


def speak(ws: websockets.sync.client.ClientConnection) -> None:
    """Speech into an open session (so the partials child is decoding)."""
    assert json.loads(ws.recv(timeout=10 * UNIT))["type"] == "session.created"
    pcm = beckett_24k(2.0)
    for i in range(0, len(pcm), 1920):
        ws.send(pcm[i : i + 1920])


def partials_config(tmp: Path) -> Path:
    """The test stages with the real pocketsphinx partials child (starts in ~1 s)."""
    raw = yaml.safe_load(TEST_YAML.read_text())
    raw["engine"]["partials"] = {"backend": "pocketsphinx", "max_streams": 2}
    path = tmp / "partials.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.models
@pytest.mark.parametrize(
    ("sig", "config"),
    [(signal.SIGINT, "cpu"), (signal.SIGTERM, "cpu"), (signal.SIGINT, "partials")],
)
def test_a_signal_to_the_process_group_stops_everything_cleanly(
    tmp_path: Path, sig: signal.Signals, config: str
) -> None:
    path = ROOT / "configs" / "cpu.yaml" if config == "cpu" else partials_config(tmp_path)
    port = free_port()
    log = tmp_path / "server.log"
    with serve(path, port, log) as proc:
        addr = f"127.0.0.1:{port}"
        wait_healthy(proc, addr, log, 180)
        members = group_members(proc.pid)
        assert any("engine.orchestration.partials_child" in cmd for _, cmd in members), members
        with websockets.sync.client.connect(f"ws://{addr}/v1/realtime", max_size=None) as ws:
            speak(ws)
            time.sleep(0.5 * UNIT)
            os.killpg(proc.pid, sig)  # what Ctrl-C in a terminal does (SIGINT)
            status = proc.wait(60 * UNIT)
        text = log.read_text()
        assert status == 0, text
        assert "Traceback" not in text, text
        assert " ERROR " not in text and " CRITICAL " not in text, text
        assert "partials process stopped" in text, text
        assert "engine stopped" in text and "server stopped" in text, text
        deadline = time.monotonic() + 10 * UNIT
        while (left := group_members(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert left == [], left


def test_a_taken_port_fails_at_once_before_any_model_loads(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for extra in ([], ["--workers", "2"]):
            start = time.monotonic()
            proc = subprocess.run(
                [*SERVE, "--config", "configs/cpu.yaml", "--port", str(port), *extra],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=120,
            )
            took = time.monotonic() - start
            assert proc.returncode == 1, proc.stderr
            assert proc.stderr.strip().splitlines()[-1] == (
                f"duplex-server: cannot listen on 127.0.0.1:{port}: the port is already in use "
                "(another server running? stop it, or choose another port with --port / PORT=)"
            ), proc.stderr
            output = proc.stdout + proc.stderr
            for started in ("loaded", "engine ready", "Started server process", "front end"):
                assert started not in output, output  # nothing started, no model loaded
            assert took < 30 * UNIT, took


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_live_session_is_told_the_server_stops_and_not_to_resume(
    tmp_path: Path, sig: signal.Signals
) -> None:
    """SIGTERM or Ctrl-C of the single-process server: the answer in flight finishes (it gets
    server.drain_s), then the session gets error{server_shutdown}, session.closed and close
    1001 (never the 1012 a client resumes after), and the server exits 0."""
    from tests.server.harness import REALTIME_TTS, write_config

    config = write_config(tmp_path, engine=REALTIME_TTS, server={"drain_s": 10.0})
    port = free_port()
    log = tmp_path / "server.log"
    with serve(config, port, log) as proc:
        addr = f"127.0.0.1:{port}"
        wait_healthy(proc, addr, log, 60)
        with websockets.sync.client.connect(f"ws://{addr}/v1/realtime") as ws:
            assert json.loads(ws.recv(timeout=10 * UNIT))["type"] == "session.created"
            item = {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "Hi"}],
            }
            ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
            ws.send(json.dumps({"type": "response.create"}))
            kinds: list[str] = []
            while "response.output_audio.delta" not in kinds:
                kinds.append(json.loads(ws.recv(timeout=10 * UNIT))["type"])
            os.killpg(proc.pid, sig)
            events = []
            with pytest.raises(websockets.ConnectionClosed) as closed:
                while True:
                    events.append(json.loads(ws.recv(timeout=20 * UNIT)))
        code = closed.value.rcvd.code if closed.value.rcvd is not None else None
        assert code == 1001, (code, [e["type"] for e in events])
        done = [e for e in events if e["type"] == "response.done"]
        assert done and done[0]["response"]["status"] == "completed"  # drained, not cut
        error = next(e for e in events if e["type"] == "error")["error"]
        assert error["code"] == "server_shutdown" and error["type"] == "server_error"
        assert "cannot be resumed" in error["message"]
        assert events[-1]["type"] == "session.closed"
        assert events[-1]["reason"] == "server_shutdown"
        assert proc.wait(30 * UNIT) == 0, log.read_text()
        text = log.read_text()
        assert "told 1 session(s) the server stops" in text, text
        assert "Traceback" not in text, text


def test_the_sdk_stops_at_the_shutdown_notice_without_resuming(tmp_path: Path) -> None:
    """The SDK's event stream ends with the notice (session.closed): no resume attempt."""
    import asyncio

    from duplex_client import DuplexClient

    port = free_port()
    log = tmp_path / "server.log"
    with serve(TEST_YAML, port, log) as proc:
        addr = f"127.0.0.1:{port}"
        wait_healthy(proc, addr, log, 60)

        async def run() -> tuple[list[str], int]:
            client = await DuplexClient.connect(f"ws://{addr}/v1/realtime")
            async with client:
                os.killpg(proc.pid, signal.SIGTERM)
                seen = []
                async for event in client.events():
                    seen.append(type(event).__name__)
                return seen, client.resumes

        seen, resumes = asyncio.run(asyncio.wait_for(run(), 30 * UNIT))
        assert seen[-2:] == ["Error", "SessionClosed"], seen
        assert resumes == 0
        assert proc.wait(30 * UNIT) == 0
