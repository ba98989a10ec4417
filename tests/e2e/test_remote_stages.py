"""A second duplex-server process on 127.0.0.1 serves ASR, LLM and TTS to the first over its
batch routes (backend ``openai``): a realtime voice turn works; killing the remote mid-reply
fails that turn (``response.done{failed}`` with a ``server_error`` naming the remote) while
the session lives on; after the remote restarts,
the same session's next turn works."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
from pathlib import Path

import yaml

from tests.e2e.test_engine_process import _status, free_port, wait_for
from tests.server.harness import (
    ROOT,
    Client,
    running_server,
    send_audio,
    silence,
    text_item,
    tone,
    write_config,
)


def start_remote(config: Path, port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "duplex_server", "serve", "--config", str(config),
         "--port", str(port), "--log-level", "warning"],
        cwd=ROOT,
    )  # fmt: skip
    wait_for(lambda: _status(f"127.0.0.1:{port}") == 200, 60, "remote ready")
    return proc


def test_a_second_instance_serves_every_stage(tmp_path: Path) -> None:
    remote_dir = tmp_path / "remote"
    remote_dir.mkdir()
    # the remote speaks at real time, so a reply lasts long enough to be cut
    remote_cfg = write_config(
        remote_dir, engine={"stages": {"tts": {"backend": "test", "options": {"realtime": True}}}}
    )
    port = free_port()
    base = f"http://127.0.0.1:{port}/v1"
    front_cfg = tmp_path / "front.yaml"
    raw = yaml.safe_load((ROOT / "configs" / "test.yaml").read_text())
    opts = {"base_url": base, "read_timeout_s": 5.0, "retries": 1, "backoff_s": 0.1}
    raw["engine"]["stages"] = {
        "asr": {"backend": "openai", "options": opts},
        "llm": {"backend": "openai", "options": opts},
        "tts": {"backend": "openai", "options": opts},
    }
    front_cfg.write_text(yaml.safe_dump(raw))
    remote = start_remote(remote_cfg, port)
    try:
        with running_server(front_cfg) as front:

            async def run() -> None:
                async with Client.connect(front) as c:
                    await c.until("session.created")
                    # 1. a voice turn: the remote hears, answers and speaks
                    await send_audio(c, silence(300) + tone(600) + silence(900))
                    heard = await c.until(
                        "conversation.item.input_audio_transcription.completed", within=10
                    )
                    assert heard["transcript"] == "what is the weather like today"
                    done = await c.until("response.done", within=20)
                    assert done["response"]["status"] == "completed", done
                    audio = [e for e in c.events if e["type"] == "response.output_audio.delta"]
                    assert audio
                    # 2. the remote dies mid-reply: the turn fails with a server_error
                    await c.send(text_item("tell me more"))
                    await c.send({"type": "response.create"})
                    await c.until("response.output_audio.delta", within=10)
                    remote.send_signal(signal.SIGKILL)
                    remote.wait(10)
                    failed = await c.until("response.done", within=15)
                    assert failed["response"]["status"] == "failed", failed
                    error = failed["response"]["status_details"]["error"]
                    assert error["type"] == "server_error", error
                    # the TTS stream is cut (or, if the kill came first, the LLM stream)
                    assert re.match(rf"remote (tts|llm) stage '\w+' at {base}: ", error["message"])
                    # 3. the remote comes back: the same session's next turn works
                    restarted = start_remote(remote_cfg, port)
                    try:
                        await asyncio.sleep(0.2)
                        await c.send(text_item("again"))
                        await c.send({"type": "response.create"})
                        done = await c.until("response.done", within=20)
                        assert done["response"]["status"] == "completed", done
                    finally:
                        restarted.send_signal(signal.SIGTERM)
                        restarted.wait(20)

            asyncio.run(run())
    finally:
        if remote.poll() is None:
            remote.send_signal(signal.SIGTERM)
            remote.wait(20)
