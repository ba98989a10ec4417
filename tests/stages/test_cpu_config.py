"""configs/cpu.yaml validates against EngineConfig and every backend's Options (no models)."""

from __future__ import annotations

from pathlib import Path

from engine.config import load_engine_config, load_yaml
from engine.stages.registry import backend_class, build_replicas

CPU_YAML = Path(__file__).resolve().parents[2] / "configs" / "cpu.yaml"


def test_cpu_config_builds_the_embedded_stack() -> None:
    config = load_engine_config(CPU_YAML)
    assert (config.stages.asr.backend, config.stages.llm.backend, config.stages.tts.backend) == (
        "whisper",
        "llamacpp",
        "piper",
    )
    assert config.vad.backend == "silero"
    names = {
        stage: type(build_replicas(stage, getattr(config.stages, stage))[0]).__name__
        for stage in ("asr", "llm", "tts")
    }
    assert names == {"asr": "WhisperAsr", "llm": "LlamaCppLlm", "tts": "PiperTts"}
    assert "server" in load_yaml(CPU_YAML)


def test_alternative_backends_have_default_options() -> None:
    for stage, backend in (("asr", "pocketsphinx"), ("tts", "espeak")):
        cls = backend_class(stage, backend)
        assert cls.Options() is not None
