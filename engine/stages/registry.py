"""Backend names used in configs -> implementing classes (imported lazily).

GPU backends (vLLM) are only imported when a config names them, so nothing in the CPU
default needs them installed.
"""

from __future__ import annotations

import importlib
from typing import Any

from engine.config import StageConfig, convert
from engine.errors import ConfigError
from engine.stages.base import StageBackend

BACKENDS: dict[str, dict[str, str]] = {
    "asr": {
        "test": "engine.stages.testing:TestStage",
        "whisper": "engine.stages.asr_whisper:WhisperAsr",
        "pocketsphinx": "engine.stages.asr_pocketsphinx:PocketsphinxAsr",
    },
    "llm": {
        "test": "engine.stages.testing:TestStage",
        "llamacpp": "engine.stages.llm_llamacpp:LlamaCppLlm",
        "vllm": "engine.stages.llm_vllm:VllmLlm",
    },
    "tts": {
        "test": "engine.stages.testing:TestStage",
        "piper": "engine.stages.tts_piper:PiperTts",
        "espeak": "engine.stages.tts_espeak:EspeakTts",
    },
}


def backend_class(stage: str, backend: str) -> Any:
    table = BACKENDS.get(stage, {})
    target = table.get(backend)
    if target is None:
        known = ", ".join(sorted(table)) or "none"
        raise ConfigError(
            f"engine.stages.{stage}.backend: unknown backend {backend!r} (known: {known})"
        )
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"engine.stages.{stage}.backend: backend {backend!r} is not installed ({exc})"
        ) from None
    return getattr(module, attr)


def build_replicas(stage: str, config: StageConfig) -> list[StageBackend]:
    """Validate ``options`` against the backend's Options struct and build the replicas."""
    cls = backend_class(stage, config.backend)
    options = convert(config.options, cls.Options, where=f"engine.stages.{stage}.options")
    return [
        cls(options, f"{stage}{i}" if config.replicas > 1 else stage)
        for i in range(config.replicas)
    ]
