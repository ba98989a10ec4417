"""The vLLM configs load and every stage's options validate (nothing is started)."""

from __future__ import annotations

import pytest

from duplex_server.config import load_app_config
from engine.graph import build_graph
from engine.stages.llm_vllm import VllmLlm
from engine.stages.registry import build_replicas
from tests.server.harness import ROOT

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("name", ["cpu-vllm.yaml", "gpu-vllm.yaml"])
def test_vllm_configs_validate(name: str) -> None:
    config = load_app_config(ROOT / "configs" / name)
    stages = config.engine.stages
    graph = build_graph(config.engine)
    for stage in ("asr", "llm", "tts"):
        assert len(graph.replicas[stage]) == stages[stage].replicas
    (llm,) = build_replicas("llm", stages["llm"])
    assert isinstance(llm, VllmLlm)
    assert llm.device == "auto"  # vLLM places itself unless a replica is pinned
    assert graph.routes["voice"].describe() == (
        "asr(audio -> text) -> llm(text -> text) -> tts(text -> audio)"
    )
    if name == "gpu-vllm.yaml":
        assert llm.options.device == "cuda" and llm.options.model
    else:
        assert llm.options.model is None and llm.options.enforce_eager
