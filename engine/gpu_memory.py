"""Do the memory shares of the stages placed on one GPU add up? Checked before any model loads.

A backend that takes GPU memory says how much (:class:`GpuMemorySource` ``gpu_memory()``): a
vLLM stage a *share* of the device (its ``gpu_memory_utilization``: weights, activations and
KV cache together), the others an estimate in GiB (CTranslate2's Whisper, the SNAC decoder;
each figure's source is in its backend). Every process that uses a GPU also holds a CUDA
context there (:data:`CONTEXT_GIB`): one per vLLM EngineCore, one for this process when an
in-process stage (Whisper, SNAC) is on that GPU.

Per ``cuda:N``: the shares must leave room for the rest. With the device's memory known
(torch sees the GPU), ``shares x memory + estimates + contexts`` must fit in
:data:`USABLE` of it; without a GPU (``duplex-server check --no-devices``) the shares alone
must stay under :data:`USABLE`, and what the rest needs is printed, to be compared with the
GPU the config is meant for.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from duplex_contract.errors import ConfigError
from engine.stages.base import StageBackend

CONTEXT_GIB = 0.5  # a CUDA context and its allocator pools, per process and GPU (estimate)
USABLE = 0.95  # of a GPU's memory: the driver and fragmentation keep some


@dataclass(frozen=True)
class GpuMemory:
    """What one replica takes on its GPU: a ``share`` of it and/or ``gib``; ``process``: its
    own process (a vLLM EngineCore) or this one."""

    share: float = 0.0
    gib: float = 0.0
    process: str = "engine"  # "own": a process of its own, with its own CUDA context


@runtime_checkable
class GpuMemorySource(Protocol):
    def gpu_memory(self) -> GpuMemory: ...


@dataclass(frozen=True)
class DeviceUse:
    device: str
    share: float
    gib: float
    users: tuple[str, ...]

    def describe(self, memory_gib: float | None) -> str:
        parts = f"shares {self.share:.2f} + {self.gib:.1f} GiB (estimates and CUDA contexts)"
        users = ", ".join(self.users)
        if memory_gib is None:
            return f"{self.device}: {parts}: {users}"
        need = self.share * memory_gib + self.gib
        return f"{self.device}: {parts} = {need:.1f} of {memory_gib:.1f} GiB: {users}"


def device_uses(replicas: Mapping[str, Sequence[StageBackend]]) -> list[DeviceUse]:
    """What the replicas (stage -> its replicas) take per GPU."""
    by_dev: dict[str, tuple[float, float, list[str], bool]] = {}
    for stage, reps in replicas.items():
        for r in reps:
            if not r.device.startswith("cuda") or not isinstance(r, GpuMemorySource):
                continue
            mem = r.gpu_memory()
            share, gib, users, engine = by_dev.get(r.device, (0.0, 0.0, [], False))
            gib += mem.gib + (CONTEXT_GIB if mem.process == "own" else 0.0)
            took = f"share {mem.share:.2f}" if mem.share else f"{mem.gib:.1f} GiB"
            users.append(f"{stage} ({took})")
            by_dev[r.device] = (share + mem.share, gib, users, engine or mem.process != "own")
    return [
        DeviceUse(dev, share, gib + (CONTEXT_GIB if engine else 0.0), tuple(users))
        for dev, (share, gib, users, engine) in sorted(by_dev.items())
    ]


def cuda_memory_gib(device: str) -> float | None:
    """The memory of GPU ``cuda:N`` as torch sees it here; None without torch or that GPU."""
    try:
        import torch
    except ImportError:
        return None
    index = int(device.partition(":")[2] or 0)
    if not torch.cuda.is_available() or index >= torch.cuda.device_count():
        return None
    return float(torch.cuda.get_device_properties(index).total_memory) / 2**30


def check_gpu_memory(
    replicas: Mapping[str, Sequence[StageBackend]], memory_gib: Callable[[str], float | None]
) -> list[DeviceUse]:
    """Refuse GPUs whose stages do not fit (module docstring); returns what each takes.
    ``memory_gib(device)``: the device's memory, None where it is not known here."""
    uses = device_uses(replicas)
    for use in uses:
        total = memory_gib(use.device)
        if total is None:
            over = use.share > USABLE
        else:
            over = use.share * total + use.gib > USABLE * total
        if over:
            raise ConfigError(
                f"engine.stages: the stages on {use.describe(total)} do not fit in "
                f"{USABLE:.0%} of the GPU: lower their gpu_memory_utilization (vLLM) or "
                "place a stage on another GPU"
            )
    return uses


__all__ = [
    "CONTEXT_GIB",
    "USABLE",
    "DeviceUse",
    "GpuMemory",
    "GpuMemorySource",
    "check_gpu_memory",
    "cuda_memory_gib",
    "device_uses",
]
