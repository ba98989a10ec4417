"""Engine configuration: frozen structs loaded and validated once, from YAML.

A bad config fails start-up with :class:`duplex_contract.errors.ConfigError` naming the field, for
example ``engine.stages.llm.replicas: Expected `int` >= 1, got `0```.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import msgspec
import yaml

from duplex_contract.errors import ConfigError
from duplex_contract.validation import explain

T = TypeVar("T")

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]


class _Frozen(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    pass


class StageConfig(_Frozen, frozen=True):
    """One named stage: which backend, how many replicas, where each runs, backend options."""

    backend: str
    replicas: PositiveInt = 1
    # One entry per replica: "cpu", "cuda", "cuda:N" or "auto" (a GPU when the backend can
    # use one and one is present, else the CPU). None: "auto" for every replica.
    devices: tuple[str, ...] | None = None
    # Validated by the backend's own Options struct at start-up (see engine/stages/backends.py).
    options: dict[str, Any] = {}

    def device_list(self) -> tuple[str, ...]:
        return self.devices if self.devices is not None else ("auto",) * self.replicas


class VadConfig(_Frozen, frozen=True):
    backend: Literal["silero", "energy"] = "silero"


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
    # give freed heap memory back to the OS this often (engine/heap.py; 0: never)
    heap_trim_interval_s: NonNegFloat = 10.0
    expiring_warning_s: NonNegFloat = 10.0
    max_session_s: NonNegFloat | None = None
    max_pending_turns: PositiveInt = 4
    max_input_bytes: PositiveInt = 16 * 1024 * 1024
    operation_cache: PositiveInt = 256
    history_budget_chars: PositiveInt = 6000
    cleanup_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 5.0
    # the session store (engine/duplex/store.py): a SQLite file the engine keeps its sessions
    # in, and takes them back from when it starts again (`duplex-server engine --state PATH`
    # sets it; `serve --workers` does). None: sessions end with the engine process.
    store_path: str | None = None


class SchedulingConfig(_Frozen, frozen=True):
    """How batch requests, speculative transcripts and draft responses share the stages
    with real-time turns (engine/orchestration/scheduling.py; docs/engine.md, "Scheduling")."""

    # serial: the CPU rules (one batch job at a time and none of its stage requests while a
    # session waits for its first audio; no guess or draft while another session's turn runs).
    # capacity: by each stage's capacity, live load and real-time budget (GPU stages that batch).
    policy: Literal["serial", "capacity"] = "serial"
    # capacity: request slots of each stage that batch work, guesses and drafts leave free;
    # `reserves` per stage name overrides it. A reserve >= the stage's capacity is refused.
    reserve: NonNegInt = 1
    reserves: dict[str, NonNegInt] = {}
    # capacity: batch jobs running at once, over all stages (a job's chained stage requests,
    # talker -> codec, share its place)
    batch_concurrency: PositiveInt = 8
    # capacity: request slots per stage, overriding what its backend declares (replicas x
    # max_batch for batching stages, max_num_seqs for vLLM, pool_size for a remote stage, 1
    # for one-at-a-time workers)
    capacity: dict[str, PositiveInt] = {}
    # capacity: a stage whose live streams get less than this many times the rate real time
    # needs (its measured pace: the talker's tokens per second per stream) takes no batch work,
    # guesses or drafts, and its drafts leave for real-time requests
    realtime_margin: Annotated[float, msgspec.Meta(ge=1.0)] = 1.2
    # capacity: no batch work, guess or draft starts on a stage while a real-time request
    # there waits for its first output. false for GPU stages that batch: a request joining a
    # batch costs the others little, and the slots and the real-time pace guard them
    hold_for_first_output: bool = True
    # capacity: the minimum share of batch work: a batch stage request that waited this long
    # starts as soon as its stage has a free slot and runs no other batch request
    batch_age_s: Annotated[float, msgspec.Meta(gt=0)] = 2.0
    # both: the longest a batch stage request waits to start; past it the request fails with
    # `server_busy` (HTTP 503, retryable) instead of waiting without bound
    batch_wait_s: Annotated[float, msgspec.Meta(gt=0)] = 30.0


class PromptConfig(_Frozen, frozen=True):
    """How a response's prompt is built around the conversation
    (engine/orchestration/prompt.py; docs/engine.md, "The prompt"). The defaults leave the
    prompt and the reply as the model makes them; configs/cpu.yaml turns each aid on for its
    135M model."""

    # "Reply in English." (the session's transcription language) at the end of the system
    # message: a small model otherwise drifts into the language a name sounds like.
    language_hint: bool = False
    # Example exchanges (user, assistant) put between the system message and the conversation
    # of a spoken reply: they show a small model the length and tone of an answer.
    spoken_examples: tuple[tuple[str, str], ...] = ()
    # Earlier turns as a note in the system message ("Earlier in this conversation: ...")
    # instead of chat messages: a small model then answers the newest question instead of
    # repeating an earlier answer. false: the conversation as chat messages.
    history_note: bool = False
    # A spoken reply ends after this many sentences (its text and audio; the LLM request is
    # stopped). null: only max_output_tokens ends it. Text replies are never cut this way.
    spoken_max_sentences: PositiveInt | None = None
    # ... and a sentence after the first is spoken only if the reply then has at most this
    # many words (it is held until it ends; one that runs past is left out). null: no limit.
    spoken_max_words: PositiveInt | None = None
    # Once a response has ended, the next prompt's start (all of it but the user's next
    # words) is evaluated into the LLM's prompt cache while the answer plays, where the
    # backend keeps one (llama.cpp): the next answer then evaluates only the new words.
    warm_next_prompt: bool = True


class EngineConfig(_Frozen, frozen=True):
    # Named stages and the routes work takes through them (engine/pipeline/graph.py,
    # docs/engine.md).
    stages: dict[str, StageConfig]
    routes: dict[str, tuple[str, ...]]
    vad: VadConfig = VadConfig()
    partials: PartialsConfig = PartialsConfig()
    segmenter: SegmenterConfig = SegmenterConfig()
    duplex: DuplexRuntimeConfig = DuplexRuntimeConfig()
    input_sample_rate: Literal[16000] = 16000
    output_sample_rate: PositiveInt = 24000
    default_instructions: str = "You are a helpful voice assistant. Answer briefly."
    max_output_tokens: PositiveInt = 96
    prompt: PromptConfig = PromptConfig()
    # Answer a pause's speculative transcript ahead of the commit and hold the output until
    # the turn commits (engine/orchestration/drafts.py); false: a response starts at the commit.
    speculative_response: bool = True
    scheduling: SchedulingConfig = SchedulingConfig()
    control_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 10.0
    # The whole stage start-up (engine/startup.py: one stage at a time per GPU); past it the
    # start fails naming the stage still starting. None: no deadline.
    start_timeout_s: Annotated[float, msgspec.Meta(gt=0)] | None = 1800.0


def convert(data: Any, type_: type[T], *, where: str) -> T:
    """msgspec.convert with errors rewritten as ``where.field: message``."""
    try:
        return msgspec.convert(data, type_, strict=False)
    except msgspec.ValidationError as exc:
        problem = explain(exc, type_)
        path = f"{where}.{problem.path}" if problem.path else where
        raise ConfigError(f"{path}: {problem.message}") from None


def load_yaml(path: str | Path) -> dict[str, Any]:
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read config {path}: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    return raw


MIGRATE_HINT = (
    "stages are named and work follows routes through them (docs/engine.md, "
    "'Migrating an old config'). Keep the stages and add, for the classic cascade:\n"
    "  routes:\n"
    "    voice: [asr, llm, tts]\n"
    "    text: [asr, llm]\n"
    "    speech: [tts]\n"
    "    transcribe: [asr]"
)
_STAGE_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_-]*$")
_DEVICE = re.compile(r"^(cpu|auto|cuda(:\d+)?)$")


def engine_config(data: Any, where: str = "engine") -> EngineConfig:
    """Convert and check the engine section (structure only; backends are checked by
    :func:`engine.pipeline.graph.build_graph` before any model loads)."""
    if isinstance(data, dict) and "routes" not in data and isinstance(data.get("stages"), dict):
        raise ConfigError(
            f"{where}.routes: missing (an old-form config?). Since 0.2 {MIGRATE_HINT}"
        )
    if isinstance(data, dict):  # per entry first, so that errors name the stage or route
        for key, type_ in (("stages", StageConfig), ("routes", tuple[str, ...])):
            entries = data.get(key)
            if isinstance(entries, dict):
                for name, entry in entries.items():
                    convert(entry, type_, where=f"{where}.{key}.{name}")
    cfg = convert(data, EngineConfig, where=where)
    if not cfg.stages:
        raise ConfigError(f"{where}.stages: at least one stage is needed")
    for name, stage in cfg.stages.items():
        at = f"{where}.stages.{name}"
        if not _STAGE_NAME.match(name):
            raise ConfigError(
                f"{at}: stage names start with a letter and use letters, digits, '_' and '-'"
            )
        if stage.devices is not None:
            if len(stage.devices) != stage.replicas:
                raise ConfigError(
                    f"{at}.devices: {len(stage.devices)} entries for {stage.replicas} "
                    "replicas; give one device per replica"
                )
            for i, dev in enumerate(stage.devices):
                if not _DEVICE.match(dev):
                    raise ConfigError(
                        f"{at}.devices[{i}]: {dev!r} is not a device (cpu, cuda, cuda:N or auto)"
                    )
    if not cfg.routes:
        raise ConfigError(f"{where}.routes: at least one route is needed")
    for rname, names in cfg.routes.items():
        at = f"{where}.routes.{rname}"
        if not names:
            raise ConfigError(f"{at}: a route names at least one stage")
        for stage_name in names:
            if stage_name not in cfg.stages:
                known = ", ".join(sorted(cfg.stages))
                raise ConfigError(
                    f"{at}: stage {stage_name!r} is not defined in {where}.stages "
                    f"(defined: {known})"
                )
        if len(set(names)) != len(names):
            raise ConfigError(f"{at}: a stage appears twice in one route")
    sched = cfg.scheduling
    for knob, named in (("capacity", sched.capacity), ("reserves", sched.reserves)):
        for stage_name in named:
            if stage_name not in cfg.stages:
                known = ", ".join(sorted(cfg.stages))
                raise ConfigError(
                    f"{where}.scheduling.{knob}.{stage_name}: no such stage in {where}.stages "
                    f"(defined: {known})"
                )
    return cfg


def load_engine_config(path: str | Path) -> EngineConfig:
    raw = load_yaml(path)
    if "engine" not in raw:
        raise ConfigError("engine: missing section")
    return engine_config(raw["engine"])
