"""``/health`` with replicas (issue 38): a stage with a replica down and another live answers
200 ``degraded`` naming the replica, and its work goes to the live one; 503 only once a
stage has no live replica. The real server on 127.0.0.1 and a real HTTP client."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import httpx

from engine.stages.testing import TestStage
from tests.server.harness import UNIT, running_server, write_config


def _health(addr: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"http://{addr}/health", timeout=5 * UNIT) as resp:
            return int(resp.status), json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return int(exc.code), json.loads(exc.read())


def test_health_is_degraded_while_a_stage_has_a_live_replica(tmp_path: Path) -> None:
    llm = {
        "backend": "test",
        "replicas": 2,
        "options": {"token_interval_s": 0.005, "down_replicas": ["llm1"]},
    }
    apps: list[Any] = []
    with running_server(write_config(tmp_path, {"stages": {"llm": llm}}), apps=apps) as addr:
        status, body = _health(addr)
        assert status == 200, body
        assert body["status"] == "degraded"
        assert body["replicas_down"] == {"llm1": "test: replica configured down"}
        replicas = apps[0].state.engine.engine.orchestrator.pools["llm"].replicas
        live, down = replicas
        assert isinstance(live, TestStage) and isinstance(down, TestStage)
        # batch work goes round-robin, but never to the replica that is down
        for i in range(3):
            chat = {"model": "x", "messages": [{"role": "user", "content": f"hi {i}"}]}
            resp = httpx.post(f"http://{addr}/v1/chat/completions", json=chat, timeout=30 * UNIT)
            assert resp.status_code == 200, resp.text
        assert len(live.submitted) == 3 and down.submitted == []
        # the last live replica goes down too: the stage has none, 503
        live.down = "test: gone as well"
        status, body = _health(addr)
        assert status == 503, body
        assert body["status"] == "unavailable"
        assert body["stages_down"] == {"llm": "test: gone as well"}
        live.down = None
        assert _health(addr)[0] == 200
