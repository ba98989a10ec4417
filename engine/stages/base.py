"""The stage interface: what the engine asks of every stage backend, and what it may ask.

A backend declares what it consumes and emits (``consumes``/``emits``,
engine/stages/edges.py) and implements four calls::

    await backend.start()                      # load models; raises on failure
    async for out in backend.submit(request):  # stream outputs of one request
    await backend.abort(request_ids)           # stop those requests (their streams end)
    await backend.close()

:class:`StageBackend` is every member the engine uses on every replica;
:class:`StageBackendClass` is what the backend table reads from a backend's class before it
builds a replica (engine/stages/backends.py). The rest is optional: a backend implements
a capability Protocol when it has that capability, and the engine asks with
``isinstance`` (never ``getattr``):

* :class:`CapacitySource` - ``capacity``: request slots of one replica (1 without it);
* :class:`ChunkerSource` - ``make_chunker()``: how the stage before it cuts its input;
* :class:`HealthSource` - ``health()``: why the replica is down, or None;
* :class:`BatchSizeSource` - ``batch_size(request_id)``: for tracing;
* elsewhere: ``start_devices()`` (:class:`engine.startup.PlacedBackend`), ``voices()``
  (:class:`engine.voices.Voiced`) and the figures of engine/stage_figures.py.

Two runtimes implement all of it for model code, held by the backend that uses one
(engine/stages/threaded.py, engine/stages/batching.py, on the worker thread of
engine/stages/workers.py); replica pools are in engine/stages/pool.py.
tests/stages/test_stage_conformance.py runs every registered backend through this.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol, runtime_checkable

import msgspec

from engine.messages import StageOutput, StageRequest
from engine.pipeline.chunkers import Chunker
from engine.stages.edges import Edge


@runtime_checkable
class StageBackend(Protocol):
    """One replica of a stage, as the engine uses it (every member is required)."""

    name: str  # the replica's name (the stage's, or ``<stage><i>`` with several)
    device: str  # its resolved placement: ``cpu``, ``cuda:N`` (or ``auto``: it places itself)
    consumes: Edge  # what one request carries in (engine/stages/edges.py)
    emits: Edge  # what its outputs carry

    @property
    def restarts(self) -> int:
        """Times this replica's worker (thread, engine, ...) was restarted."""
        ...

    async def start(self) -> None: ...

    def submit(self, request: StageRequest) -> AsyncIterator[StageOutput]: ...

    async def abort(self, request_ids: Sequence[str]) -> None: ...

    async def close(self) -> None: ...


@runtime_checkable
class StageBackendClass(Protocol):
    """A backend's class, as the backend table uses it before any replica exists."""

    @property
    def Options(self) -> type[msgspec.Struct]:
        """The options struct ``engine.stages.<name>.options`` is checked against."""
        ...

    @property
    def device_kinds(self) -> frozenset[str]:
        """Device kinds it can run on (``cpu``, ``cuda``)."""
        ...

    @property
    def keeps_auto(self) -> bool:
        """``auto`` stays ``auto`` (the backend places itself) instead of cuda:0/cpu."""
        ...

    def cuda_device_count(self) -> int:
        """CUDA devices it can use on this machine (0: CPU only)."""
        ...

    def __call__(
        self, options: Any, name: str, *, device: str = ..., stage: str | None = ...
    ) -> StageBackend: ...


@runtime_checkable
class CapacitySource(Protocol):
    """Request slots of one replica: requests it serves at once (batch size, sequences).
    The scheduler sizes its admission by it (engine/orchestration/scheduling.py); 1 without it."""

    @property
    def capacity(self) -> int: ...


@runtime_checkable
class ChunkerSource(Protocol):
    """The chunker that cuts this stage's input from the stage before it (None: the
    default for the edge it consumes, engine/pipeline/chunkers.py)."""

    def make_chunker(self) -> Chunker | None: ...


@runtime_checkable
class HealthSource(Protocol):
    """Why the replica is down (a remote's open circuit, a dead engine), or None."""

    def health(self) -> str | None: ...


@runtime_checkable
class BatchSizeSource(Protocol):
    """The most requests one step ran together with ``request_id`` (0: unknown)."""

    def batch_size(self, request_id: str) -> int: ...


def protocol_members(protocol: type) -> list[str]:
    """The members a Protocol of this module names: attributes, properties and methods."""
    body = vars(protocol)
    names = set(body.get("__annotations__", {}))
    names.update(
        n
        for n, v in body.items()
        if (not n.startswith("_") or n == "__call__") and (callable(v) or isinstance(v, property))
    )
    return sorted(names)


def missing_members(obj: object, protocol: type) -> list[str]:
    """The members of ``protocol`` that ``obj`` lacks (empty: it has them all)."""
    return [n for n in protocol_members(protocol) if not hasattr(obj, n)]
