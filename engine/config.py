"""Engine configuration: frozen structs loaded and validated once, from YAML.

A bad config fails start-up with :class:`engine.errors.ConfigError` naming the field, for
example ``engine.stages.llm.replicas: Expected `int` >= 1, got `0```.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import msgspec
import yaml

from engine.errors import ConfigError

T = TypeVar("T")

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0)]


class _Frozen(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    pass


class StageConfig(_Frozen, frozen=True):
    """One stage of the pipeline: which backend, how many replicas, backend options."""

    backend: str
    replicas: PositiveInt = 1
    # Validated by the backend's own Options struct at start-up (see stages/registry.py).
    options: dict[str, Any] = {}


class StagesConfig(_Frozen, frozen=True):
    asr: StageConfig
    llm: StageConfig
    tts: StageConfig


class VadConfig(_Frozen, frozen=True):
    backend: Literal["silero", "energy"] = "silero"
    threshold: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.5


class PartialsConfig(_Frozen, frozen=True):
    """Live partial user transcripts while the user speaks (best effort)."""

    backend: Literal["none", "pocketsphinx"] = "none"
    max_streams: PositiveInt = 8  # concurrent sessions that get partials


class SegmenterConfig(_Frozen, frozen=True):
    first_min_words: PositiveInt = 3
    first_max_words: PositiveInt = 6
    max_words: PositiveInt = 40


class DuplexRuntimeConfig(_Frozen, frozen=True):
    max_sessions: PositiveInt = 64
    idle_ttl_s: NonNegFloat | None = 300.0
    disconnect_grace_s: NonNegFloat = 30.0
    reaper_interval_s: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    expiring_warning_s: NonNegFloat = 10.0
    max_session_s: NonNegFloat | None = None
    max_pending_turns: PositiveInt = 4
    max_input_bytes: PositiveInt = 16 * 1024 * 1024
    operation_cache: PositiveInt = 256
    history_budget_chars: PositiveInt = 6000
    cleanup_retry_s: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    cleanup_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 5.0


class EngineConfig(_Frozen, frozen=True):
    stages: StagesConfig
    vad: VadConfig = VadConfig()
    partials: PartialsConfig = PartialsConfig()
    segmenter: SegmenterConfig = SegmenterConfig()
    duplex: DuplexRuntimeConfig = DuplexRuntimeConfig()
    input_sample_rate: Literal[16000] = 16000
    output_sample_rate: PositiveInt = 24000
    default_instructions: str = "You are a helpful voice assistant. Answer briefly."
    max_output_tokens: PositiveInt = 96
    control_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 10.0


_PATH_RE = re.compile(r" - at `\$\.?(?P<path>[^`]*)`$")


def convert(data: Any, type_: type[T], *, where: str) -> T:
    """msgspec.convert with errors rewritten as ``where.field: message``."""
    try:
        return msgspec.convert(data, type_, strict=False)
    except msgspec.ValidationError as exc:
        text = str(exc)
        match = _PATH_RE.search(text)
        path = where
        if match:
            inner = match.group("path").replace("[", ".").replace("]", "")
            path = f"{where}.{inner}" if inner else where
            text = text[: match.start()]
        unknown = re.match(r"Object contains unknown field `(?P<f>[^`]+)`", text)
        if unknown:
            path = f"{path}.{unknown.group('f')}"
        raise ConfigError(f"{path}: {text}") from None


def load_yaml(path: str | Path) -> dict[str, Any]:
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read config {path}: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    return raw


def load_engine_config(path: str | Path) -> EngineConfig:
    raw = load_yaml(path)
    if "engine" not in raw:
        raise ConfigError("engine: missing section")
    return convert(raw["engine"], EngineConfig, where="engine")
