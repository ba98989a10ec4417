"""GPU placement of a replica: which GPUs it uses, and what its own process must see.

Pure functions (no torch, no environment reads: the caller passes both in), used by the vLLM
stages at build time and by :mod:`engine.startup` to order start-up per device.

Indices mean what they mean to torch in this process: ``cuda:N`` (a replica's entry in
``devices``) and the vLLM option ``device_ids`` are positions in the list of GPUs this
process sees, i.e. in ``CUDA_VISIBLE_DEVICES`` when that is set. A vLLM replica's EngineCore
process is given exactly its GPUs: ``CUDA_VISIBLE_DEVICES`` for the child is the entries of
the parent's list at those positions (or the indices themselves when the parent sets none).

Errors (:class:`ConfigError`, naming the stage's field):

* ``device_ids`` with a negative index, a duplicate, a count other than
  ``tensor_parallel_size``, an index past the GPUs CUDA reports, or not containing the
  replica's own ``cuda:N``;
* a replica on one ``cuda:N`` with ``tensor_parallel_size > 1`` and no ``device_ids``;
* a preset ``CUDA_VISIBLE_DEVICES`` that hides a GPU the replica is pinned to (``cuda:2``
  while the variable lists two GPUs, or ``""``/``-1``, which hide every GPU).
"""

from __future__ import annotations

from collections.abc import Sequence

from duplex_contract.errors import ConfigError

__all__ = ["child_visible_devices", "replica_gpus", "visible_entries"]


def visible_entries(value: str | None) -> list[str] | None:
    """The GPUs a ``CUDA_VISIBLE_DEVICES`` value shows, in order (None: the variable is
    unset, every GPU is visible). As CUDA does, the list ends at the first negative entry
    (``-1`` hides everything after it); entries may be indices or ``GPU-``/``MIG-`` UUIDs."""
    if value is None:
        return None
    out: list[str] = []
    for raw in value.split(","):
        entry = raw.strip()
        if not entry or entry.startswith("-"):
            break
        out.append(entry)
    return out


def replica_gpus(
    *,
    device: str,
    device_ids: Sequence[int] | None,
    tensor_parallel_size: int,
    cuda_count: int,
    where: str,
    replica: str,
) -> tuple[int, ...] | None:
    """The GPU indices a vLLM replica runs on, or None when it is not pinned (``auto``, CPU:
    vLLM places itself). ``cuda_count`` is what CUDA reports here (0: no CUDA, the range is
    not checked); ``where`` is the stage's config path (``engine.stages.llm``)."""
    kind, _, index = device.partition(":")
    if device_ids is not None:
        at = f"{where}.options.device_ids"
        ids = tuple(device_ids)
        if not ids:
            raise ConfigError(f"{at}: empty; list the GPUs of each replica, or leave it null")
        for i in ids:
            if i < 0:
                raise ConfigError(f"{at}: {i} is not a GPU index (0, 1, ...)")
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if dup:
            raise ConfigError(f"{at}: GPU {dup[0]} is listed twice in {list(ids)}")
        if len(ids) != tensor_parallel_size:
            raise ConfigError(
                f"{at}: {len(ids)} GPU(s) {list(ids)} for tensor_parallel_size="
                f"{tensor_parallel_size}; list exactly one GPU per tensor-parallel rank"
            )
        if cuda_count > 0:
            past = [i for i in ids if i >= cuda_count]
            if past:
                raise ConfigError(
                    f"{at}: GPU {past[0]} does not exist: CUDA reports {cuda_count} GPU(s) "
                    f"here (indices 0-{cuda_count - 1})"
                )
        if kind == "cpu":
            raise ConfigError(f"{at}: replica {replica} is placed on 'cpu', which has no GPUs")
        if kind == "cuda" and index and int(index) not in ids:
            raise ConfigError(
                f"{where}.devices: replica {replica} is placed on {device!r}, which "
                f"{where}.options.device_ids {list(ids)} does not include"
            )
        return ids
    if kind != "cuda":
        return None
    gpu = int(index or 0)
    if tensor_parallel_size > 1:
        raise ConfigError(
            f"{where}.options.device_ids: replica {replica} is placed on {device!r} with "
            f"tensor_parallel_size={tensor_parallel_size}; list its {tensor_parallel_size} "
            "GPUs in device_ids"
        )
    return (gpu,)


def child_visible_devices(
    gpus: Sequence[int], preset: str | None, *, where: str, replica: str
) -> str:
    """``CUDA_VISIBLE_DEVICES`` for the process of a replica pinned to ``gpus``, given this
    process's own value ``preset`` (None: unset). A preset value that does not show one of
    ``gpus`` is an error naming the replica."""
    shown = visible_entries(preset)
    if shown is None:
        return ",".join(str(i) for i in gpus)
    missing = [i for i in gpus if i >= len(shown)]
    if missing:
        listed = f"{len(shown)} GPU(s) ({','.join(shown)})" if shown else "no GPU"
        raise ConfigError(
            f"{where}: replica {replica} is pinned to cuda:{missing[0]}, but this process's "
            f"environment sets CUDA_VISIBLE_DEVICES={preset!r}, which shows {listed}; pin "
            "the replica to a GPU it shows (cuda:N counts from the first GPU listed there) "
            "or unset the variable"
        )
    return ",".join(shown[i] for i in gpus)
