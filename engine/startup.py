"""Start-up of the stage pools: one stage at a time per GPU, GPUs in parallel, one deadline.

Two engines that profile a GPU's free memory at the same time (vLLM sizes its KV cache from
what is free while CTranslate2 or torch allocate beside it) can both mis-size. So the
replicas that use a GPU start **one after another on that GPU**, in config order (stages as
listed under ``engine.stages``, then replica order); replicas on different GPUs, and every
replica that uses no GPU (``cpu``, a remote stage), start in parallel. A replica that spans
several GPUs (vLLM with tensor parallelism, or ``auto``) takes all of them.

Which GPUs a replica takes: its ``start_devices()`` when it has one (the vLLM stages: their
pinned GPUs, or every GPU for ``auto``), else its ``device`` when that is ``cuda:N``.

The whole start-up has one deadline, ``engine.start_timeout_s``; past it, start-up fails with
a :class:`ConfigError` naming the replicas still starting (and how long they took so far)
and the ones queued behind them. The first replica that fails to start fails the start-up
with its own error; the others are cancelled (the caller closes every pool).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from duplex_contract.errors import ConfigError
from engine.stages.base import StageBackend
from engine.stages.pool import StagePool

log = logging.getLogger(__name__)

__all__ = ["PlacedBackend", "StartRecord", "start_devices", "start_pools"]


@runtime_checkable
class PlacedBackend(Protocol):
    def start_devices(self) -> frozenset[str]: ...


def start_devices(replica: StageBackend) -> frozenset[str]:
    """The GPUs (``cuda:N``) ``replica`` occupies while it starts; empty: none."""
    if isinstance(replica, PlacedBackend):
        return replica.start_devices()
    kind, _, index = replica.device.partition(":")
    return frozenset({f"cuda:{int(index or 0)}"}) if kind == "cuda" else frozenset()


@dataclass
class StartRecord:
    """One replica's start, as it happened (times from ``time.monotonic``)."""

    stage: str
    replica: str
    devices: frozenset[str]
    queued_at: float
    started_at: float | None = None  # its devices were free and it began
    ready_at: float | None = None
    after: list[StartRecord] = field(default_factory=list)  # the previous one on each GPU
    finished: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def where(self) -> str:
        return ",".join(sorted(self.devices)) or "no GPU"


async def start_pools(pools: Mapping[str, StagePool], timeout_s: float | None) -> list[StartRecord]:
    """Start every replica of ``pools`` (see the module docstring); returns how it went."""
    last: dict[str, StartRecord] = {}  # per GPU, the replica that started on it last
    records: list[StartRecord] = []
    jobs: list[tuple[StartRecord, StageBackend]] = []
    now = time.monotonic()
    for stage, pool in pools.items():
        for replica in pool.replicas:
            devices = start_devices(replica)
            record = StartRecord(stage, replica.name, devices, now)
            record.after = [last[d] for d in sorted(devices) if d in last]
            last.update(dict.fromkeys(devices, record))
            records.append(record)
            jobs.append((record, replica))

    async def start_one(record: StartRecord, replica: StageBackend) -> None:
        try:
            for before in record.after:  # config order on every GPU it takes
                await before.finished.wait()
            record.started_at = time.monotonic()
            await replica.start()
            record.ready_at = time.monotonic()
        finally:
            record.finished.set()
        log.info(
            "stage %s: replica %s (%s) started in %.1f s",
            record.stage,
            record.replica,
            record.where,
            record.ready_at - record.started_at,
        )

    tasks = [
        asyncio.create_task(start_one(rec, rep), name=f"start:{rec.replica}") for rec, rep in jobs
    ]
    if not tasks:
        return records
    try:
        done, pending = await asyncio.wait(
            tasks, timeout=timeout_s, return_when=asyncio.FIRST_EXCEPTION
        )
        for task in done:
            exc = None if task.cancelled() else task.exception()
            if exc is not None:
                raise exc
        if pending:
            raise ConfigError(_timeout_message(records, timeout_s))
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return records


def _timeout_message(records: list[StartRecord], timeout_s: float | None) -> str:
    now = time.monotonic()
    starting = [r for r in records if r.started_at is not None and r.ready_at is None]
    queued = [r for r in records if r.started_at is None]
    parts = [
        f"stage {r.stage!r} (replica {r.replica} on {r.where}) still starting after "
        f"{now - (r.started_at or now):.1f} s"
        for r in starting
    ]
    if queued:
        parts.append("queued behind it: " + ", ".join(f"{r.replica} ({r.where})" for r in queued))
    return f"engine.start_timeout_s: the stages did not start within {timeout_s:g} s: " + "; ".join(
        parts
    )
