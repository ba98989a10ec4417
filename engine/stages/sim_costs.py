"""Cost files of the simulated GPU (configs/sim/h200-costs.yaml), and the swap that measures a
deployable config on them.

A cost file holds one device's figures, keyed by stage: how long a call or a decode step
takes (the sim stage's cost model, engine/stages/sim.py), what a stage holds in device
memory (``weights_gib``, ``kv_bytes_per_token``; ``memory_gib`` for stages that are not
vLLM), optional host CPU per item, and where each figure comes from (``source``)::

    device: {name: H200, memory_gib: 131}
    stages:
      talker: {step_ms: 7, step_ms_per_seq: 0.06, weights_gib: 6.6, kv_bytes_per_token: 114688,
               source: "estimate"}

A sim stage names its file and entry (``cost_file``, ``cost_key``: its role or stage name by
default); a cost from the file applies to every option the config leaves at its default.

:func:`simulate_config` turns an engine config a user deploys (configs/gpu-talker.yaml) into
one that runs on the simulated device: each stage's backend becomes ``sim`` in the role its
backend plays, keeping the config's routes, devices, replicas, scheduling, and the caps the
real backend's options set (vLLM's ``max_num_seqs``, ``max_batch``, the codec's windows, the
talker's ``max_frames``, a remote talker's ``pool_size``); its KV cache is derived from its
memory share (``gpu_memory_utilization`` x the device's memory, less the weights); the ASR's
words depend on the audio and the LLM's reply on the prompt.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import msgspec
import yaml

from duplex_contract.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]

NonNeg = Annotated[float, msgspec.Meta(ge=0)]

#: backends -> the sim role that plays them
ROLE_OF_BACKEND = {
    "whisper": "asr",
    "pocketsphinx": "asr",
    "vllm": "llm",
    "llamacpp": "llm",
    "vllm-talker": "talker",
    "openai-talker": "talker",
    "snac": "codec",
    "sim": "",
}
#: options of a real backend that the sim keeps (its caps and windows)
KEPT = (
    "max_num_seqs",
    "max_batch",
    "gather_ms",
    "first_frames",
    "window_frames",
    "context_frames",
    "lookahead_frames",
    "max_frames",
)


class DeviceCosts(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    memory_gib: Annotated[float, msgspec.Meta(gt=0)]


class StageCosts(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One stage's figures; what is left out keeps the sim's default."""

    source: str = ""  # where the figures come from
    call_ms: NonNeg | None = None
    item_ms: NonNeg | None = None
    call_ms_at: dict[Annotated[int, msgspec.Meta(ge=1)], NonNeg] | None = None
    step_ms: NonNeg | None = None
    step_ms_per_seq: NonNeg | None = None
    prefill_ms_per_token: NonNeg | None = None
    kv_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    host_us_per_item: NonNeg | None = None
    host_source: str = ""
    weights_gib: NonNeg | None = None  # vLLM stages: weights in device memory
    kv_bytes_per_token: Annotated[int, msgspec.Meta(ge=1)] | None = None
    memory_gib: NonNeg | None = None  # other stages: what they hold on the device

    def options(self) -> dict[str, Any]:
        """The sim options it sets (not the host CPU cost: a bench asks for that apart,
        ``bench/gpu_sim.py --host-cpu``)."""
        keys = (
            "call_ms",
            "item_ms",
            "call_ms_at",
            "step_ms",
            "step_ms_per_seq",
            "prefill_ms_per_token",
            "kv_tokens",
        )
        raw = msgspec.structs.asdict(self)
        return {k: raw[k] for k in keys if raw[k] is not None}


class CostFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    device: DeviceCosts
    stages: dict[str, StageCosts]


def resolve(path: str | Path) -> Path:
    """A cost file's path: as given, or under the repository root."""
    p = Path(path)
    return p if p.is_absolute() or p.exists() else ROOT / p


def load_costs(path: str | Path, *, where: str = "cost_file") -> CostFile:
    p = resolve(path)
    try:
        raw = yaml.safe_load(p.read_text())
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read {path}: {exc}") from None
    try:
        return msgspec.convert(raw, CostFile)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{where}: {path}: {exc}") from None


def cost_file_of(path: str | Path) -> Path:
    """``path`` if it is a cost file; if it is a sim config (an ``engine:`` of sim stages),
    the cost file its stages name."""
    p = resolve(path)
    raw = yaml.safe_load(p.read_text())
    if not isinstance(raw, dict) or "engine" not in raw:
        return p
    for stage in raw["engine"].get("stages", {}).values():
        named = (stage.get("options") or {}).get("cost_file")
        if stage.get("backend") == "sim" and named:
            return resolve(named)
    raise ConfigError(f"{path}: a sim config whose stages name no cost_file")


def kv_tokens(costs: StageCosts, share: float, device_gib: float) -> int | None:
    """KV cache tokens of a vLLM stage that takes ``share`` of a ``device_gib`` device."""
    if costs.weights_gib is None or costs.kv_bytes_per_token is None:
        return None
    free = share * device_gib - costs.weights_gib
    if free <= 0:
        return None
    return int(free * 2**30 / costs.kv_bytes_per_token)


def simulate_config(engine: dict[str, Any], cost_path: str | Path) -> dict[str, Any]:
    """``engine`` (an ``engine:`` section as loaded from YAML) with every stage on the sim
    backend of ``cost_path`` (see the module docstring)."""
    costs = load_costs(cost_path)
    out = dict(engine)
    stages: dict[str, Any] = {}
    for name, stage in engine["stages"].items():
        backend = stage["backend"]
        opts = stage.get("options") or {}
        role = ROLE_OF_BACKEND.get(backend)
        if role is None:
            raise ConfigError(
                f"engine.stages.{name}.backend: {backend!r} has no simulated role "
                f"(the sim plays: {', '.join(b for b in ROLE_OF_BACKEND if b != 'sim')})"
            )
        if backend == "sim":
            stages[name] = stage
            continue
        sim: dict[str, Any] = {"role": role, "cost_file": str(cost_path)}
        if role == "asr":
            sim["transcript"] = None  # words that depend on the audio
        elif role == "llm":
            sim["reply"] = None  # a reply that depends on the prompt
        sim["cost_key"] = name if name in costs.stages else role
        sim.update({k: opts[k] for k in KEPT if k in opts})
        if backend == "openai-talker" and "pool_size" in opts:
            sim["max_num_seqs"] = opts["pool_size"]  # the remote pool's concurrency
        entry = costs.stages.get(sim["cost_key"])
        share = opts.get("gpu_memory_utilization")
        if entry is not None and share is not None:
            kv = kv_tokens(entry, float(share), costs.device.memory_gib)
            if kv is not None:
                sim["kv_tokens"] = kv
        stages[name] = {k: v for k, v in stage.items() if k != "options"}
        stages[name].update(backend="sim", options=sim)
    out["stages"] = stages
    out.pop("partials", None)
    return out


__all__ = [
    "KEPT",
    "ROLE_OF_BACKEND",
    "CostFile",
    "DeviceCosts",
    "StageCosts",
    "cost_file_of",
    "kv_tokens",
    "load_costs",
    "simulate_config",
]
