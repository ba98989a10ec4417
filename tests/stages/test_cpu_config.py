"""configs/cpu.yaml validates against EngineConfig and every backend's Options (no models)."""

from __future__ import annotations

from pathlib import Path

from engine.config import load_engine_config, load_yaml
from engine.pipeline.graph import build_graph
from engine.stages.asr_whisper import WhisperAsr
from engine.stages.backends import backend_class

CPU_YAML = Path(__file__).resolve().parents[2] / "configs" / "cpu.yaml"


def test_cpu_config_builds_the_embedded_stack() -> None:
    config = load_engine_config(CPU_YAML)
    backends = {name: stage.backend for name, stage in config.stages.items()}
    assert backends == {"asr": "whisper", "llm": "llamacpp", "tts": "piper"}
    assert config.vad.backend == "silero"
    graph = build_graph(config)
    names = {stage: type(replicas[0]).__name__ for stage, replicas in graph.replicas.items()}
    assert names == {"asr": "WhisperAsr", "llm": "LlamaCppLlm", "tts": "PiperTts"}
    assert [getattr(r, "device", None) for r in graph.replicas["asr"]] == ["cpu"]
    asr = graph.replicas["asr"][0]
    assert isinstance(asr, WhisperAsr) and asr.runtime.max_batch == 1
    assert graph.routes["voice"].describe() == (
        "asr(audio -> text) -> llm(text -> text) -> tts(text -> audio)"
    )
    assert "server" in load_yaml(CPU_YAML)


def test_alternative_backends_have_default_options() -> None:
    for backend in ("pocketsphinx", "espeak"):
        cls = backend_class(backend)
        assert cls.Options() is not None


def test_cpu_config_runs_one_thread_per_stage() -> None:
    """The stages run at the same time and share two cores: one thread each (why: the
    comment in configs/cpu.yaml)."""
    config = load_engine_config(CPU_YAML)
    opts = {name: stage.options for name, stage in config.stages.items()}
    assert opts["asr"]["cpu_threads"] == 1
    assert opts["llm"]["n_threads"] == 1
    assert opts["llm"]["n_threads_alone"] == 2  # a lone answer may use both cores
    assert opts["tts"]["threads"] == 1
