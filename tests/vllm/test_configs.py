"""The vLLM configs load and every stage's options validate (nothing is started)."""

from __future__ import annotations

import pytest

from duplex_server.config import load_app_config
from engine.stages.llm_vllm import VllmLlm
from engine.stages.registry import build_replicas
from tests.server.harness import ROOT

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("name", ["cpu-vllm.yaml", "gpu-vllm.yaml"])
def test_vllm_configs_validate(name: str) -> None:
    config = load_app_config(ROOT / "configs" / name)
    stages = config.engine.stages
    for stage in ("asr", "llm", "tts"):
        replicas = build_replicas(stage, getattr(stages, stage))
        assert len(replicas) == getattr(stages, stage).replicas
    (llm,) = build_replicas("llm", stages.llm)
    assert isinstance(llm, VllmLlm)
    if name == "gpu-vllm.yaml":
        assert llm.options.device == "cuda" and llm.options.model
    else:
        assert llm.options.model is None and llm.options.enforce_eager
