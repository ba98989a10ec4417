"""The vLLM configs load and every stage's options validate (nothing is started)."""

from __future__ import annotations

import pytest

from duplex_server.config import load_app_config
from engine.pipeline.graph import build_graph
from engine.stages.backends import build_replicas
from engine.stages.llm_vllm import VllmLlm
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


@pytest.mark.parametrize("name", ["cpu-talker-test.yaml", "gpu-talker.yaml"])
def test_talker_configs_validate(name: str) -> None:
    """Both talker configs build their stages and routes (GPU placements checked as CPU here:
    this machine has no GPU; the options are validated all the same)."""
    import msgspec

    from engine.stages.codec_snac import SnacCodec
    from engine.stages.talker_vllm import VllmTalker

    config = load_app_config(ROOT / "configs" / name).engine
    stages = {
        k: msgspec.structs.replace(
            s, devices=None if s.devices is None else ("cpu",) * len(s.devices)
        )
        for k, s in config.stages.items()
    }
    graph = build_graph(msgspec.structs.replace(config, stages=stages))
    (talker,) = graph.replicas["talker"]
    (codec,) = graph.replicas["codec"]
    assert isinstance(talker, VllmTalker) and isinstance(codec, SnacCodec)
    assert graph.routes["voice"].describe() == (
        "asr(audio -> text) -> llm(text -> text) -> talker(text -> codec) -> codec(codec -> audio)"
    )
    assert graph.routes["speech"].describe() == "talker(text -> codec) -> codec(codec -> audio)"
    assert codec.exact  # context and look-ahead cover SNAC's reach: chunks join exactly
    if name == "gpu-talker.yaml":
        assert config.stages["codec"].devices == ("cuda:0",)
        assert talker.topts.model and codec.opts.model and talker.topts.device == "cuda"
    else:
        assert talker.topts.model is None and codec.opts.model is None


@pytest.mark.parametrize("name", ["cpu-talker-remote-test.yaml", "gpu-talker-remote.yaml"])
def test_remote_talker_configs_validate(name: str) -> None:
    """The remote-talker configs build their graph: the talker a client of `vllm serve`
    (text -> codec), the codec here (GPU placements checked as CPU: no GPU on this machine)."""
    import msgspec

    from engine.stages.codec_snac import SnacCodec
    from engine.stages.talker_remote import RemoteTalker

    config = load_app_config(ROOT / "configs" / name).engine
    stages = {
        k: msgspec.structs.replace(
            s, devices=None if s.devices is None else ("cpu",) * len(s.devices)
        )
        for k, s in config.stages.items()
    }
    graph = build_graph(msgspec.structs.replace(config, stages=stages))
    (talker,) = graph.replicas["talker"]
    (codec,) = graph.replicas["codec"]
    assert isinstance(talker, RemoteTalker) and isinstance(codec, SnacCodec)
    assert graph.routes["speech"].describe() == "talker(text -> codec) -> codec(codec -> audio)"
    assert talker.topts.request_id_field and talker.base_url.startswith("http://")
    assert codec.exact
