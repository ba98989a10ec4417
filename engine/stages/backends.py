"""Backend names used in configs -> implementing classes (imported lazily).

The table is flat: a backend is known by its name alone, whatever stage it serves; what it
consumes and emits is its own declaration (``consumes`` / ``emits``), checked against the
routes by :func:`engine.pipeline.graph.build_graph`. Adding a stage kind means adding its
backend here and nothing else. GPU backends (vLLM) are only imported when a config names them, so
nothing in the CPU default needs them installed.

Device placement: each replica gets one entry of ``devices`` (``cpu``, ``cuda``, ``cuda:N``
or ``auto``). A backend lists the device kinds it can use in ``device_kinds`` and reports
how many GPUs it can see with ``cuda_device_count()``; ``auto`` picks ``cuda:0`` when the
backend can use a GPU and sees one, else ``cpu``. A GPU asked for where none exists is a
start-up error naming the stage and the replica.
"""

from __future__ import annotations

import importlib

from duplex_contract.errors import ConfigError
from engine.config import StageConfig, convert
from engine.stages.base import StageBackend, StageBackendClass, missing_members

BACKENDS: dict[str, str] = {
    # deterministic test stages (any role; see engine/stages/testing.py)
    "test": "engine.stages.testing:TestStage",
    "test-batch": "engine.stages.testing_batch:BatchTestStage",
    # a simulated GPU: asr, llm, talker or codec timed by a cost model (engine/stages/sim.py)
    "sim": "engine.stages.sim:SimStage",
    # speech recognition: audio -> text
    "whisper": "engine.stages.asr_whisper:WhisperAsr",
    "pocketsphinx": "engine.stages.asr_pocketsphinx:PocketsphinxAsr",
    # responders: text -> text
    "llamacpp": "engine.stages.llm_llamacpp:LlamaCppLlm",
    "vllm": "engine.stages.llm_vllm:VllmLlm",
    # any OpenAI-compatible server (vllm serve, another duplex-server, ...): llm, asr or tts
    "openai": "engine.stages.openai_remote:OpenAIStage",
    # speech synthesis: text -> audio
    "piper": "engine.stages.tts_piper:PiperTts",
    "espeak": "engine.stages.tts_espeak:EspeakTts",
    # talkers: text -> codec frames (a codec LM on vLLM; engine/codec_layout.py)
    "vllm-talker": "engine.stages.talker_vllm:VllmTalker",
    # the same talker on a `vllm serve` pool (engine/stages/talker_remote.py)
    "openai-talker": "engine.stages.talker_remote:RemoteTalker",
    # codec decoders: codec frames -> audio (torch)
    "snac": "engine.stages.codec_snac:SnacCodec",
}


def backend_class(backend: str, *, where: str = "engine.stages.?") -> StageBackendClass:
    target = BACKENDS.get(backend)
    if target is None:
        known = ", ".join(sorted(BACKENDS))
        raise ConfigError(f"{where}.backend: unknown backend {backend!r} (known: {known})")
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"{where}.backend: backend {backend!r} is not installed ({exc})"
        ) from None
    cls = getattr(module, attr)  # (a module's attribute, named by the table above)
    missing = missing_members(cls, StageBackendClass)
    if missing:
        raise ConfigError(
            f"{where}.backend: backend {backend!r} ({target}) does not implement the stage "
            f"interface: it lacks {', '.join(missing)} (engine/stages/base.py)"
        )
    backend_cls: StageBackendClass = cls
    return backend_cls


def resolve_device(
    cls: StageBackendClass, backend: str, device: str, where: str, *, check_devices: bool = True
) -> str:
    """``auto`` -> a concrete device; refuse what the backend or the machine can't do
    (``check_devices=False``: a ``cuda:N`` is taken as it is, without counting this
    machine's GPUs: a GPU config checked on a machine without one)."""
    kinds = cls.device_kinds
    if device == "auto" and cls.keeps_auto:
        return device  # the backend places itself
    if device == "auto":
        if "cuda" in kinds and cls.cuda_device_count() > 0:
            return "cuda:0"
        return "cpu"
    kind, _, index = device.partition(":")
    if kind not in kinds:
        raise ConfigError(
            f"{where}: backend {backend!r} cannot run on {device!r} "
            f"(it runs on: {', '.join(sorted(kinds))})"
        )
    if kind == "cuda" and not check_devices:
        return f"cuda:{int(index or 0)}"
    if kind == "cuda":
        count = cls.cuda_device_count()
        idx = int(index or 0)
        if idx >= count:
            raise ConfigError(
                f"{where}: {device!r} requested, but backend {backend!r} sees "
                f"{count} CUDA device(s) on this machine"
            )
        return f"cuda:{idx}"
    return device


def build_replicas(
    stage: str, config: StageConfig, *, check_devices: bool = True
) -> list[StageBackend]:
    """Validate ``options`` and ``devices`` against the backend and build the replicas
    (``check_devices``: see :func:`resolve_device`).

    Nothing is loaded here: models load in ``start()``.
    """
    where = f"engine.stages.{stage}"
    cls = backend_class(config.backend, where=where)
    options = convert(config.options, cls.Options, where=f"{where}.options")
    replicas: list[StageBackend] = []
    for i, dev in enumerate(config.device_list()):
        at = f"{where}.devices[{i}]"
        device = resolve_device(cls, config.backend, dev, at, check_devices=check_devices)
        name = f"{stage}{i}" if config.replicas > 1 else stage
        replicas.append(cls(options, name, device=device, stage=stage))
    return replicas
