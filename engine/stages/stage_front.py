"""The stage interface passed on to the object that serves it, written once.

A model backend holds a runtime (:class:`~engine.stages.threaded.ThreadedRuntime`,
:class:`~engine.stages.batching.BatchingRuntime`) and a runtime holds its
:class:`~engine.stages.workers.Worker`; each gives the engine the same members (``restarts``,
``on_wait``, ``start``, ``submit``, ``abort``, ``close``, ``batch_size``) by passing them on.
:class:`StageFront` is that passing on: a class names what serves it (:meth:`serving`) and
gets the members. :class:`BatchingFront` adds a batching runtime's ``on_step`` hook.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from typing import Protocol

from engine.messages import StageOutput, StageRequest


class Served(Protocol):
    """What serves a stage: a runtime or a worker."""

    @property
    def restarts(self) -> int: ...

    on_wait: Callable[[float], None] | None

    async def start(self) -> None: ...

    def submit(self, request: StageRequest) -> AsyncIterator[StageOutput]: ...

    async def abort(self, request_ids: Sequence[str]) -> None: ...

    async def close(self) -> None: ...

    def batch_size(self, request_id: str) -> int: ...


class BatchServed(Served, Protocol):
    """A batching runtime: also a hook told each step's size."""

    on_step: Callable[[int], None] | None


class StageFront:
    """The stage interface of a class whose :meth:`serving` object does the work."""

    def serving(self) -> Served:
        raise NotImplementedError

    @property
    def restarts(self) -> int:
        """How often the model's worker thread was started again after a crash."""
        return self.serving().restarts

    @property
    def on_wait(self) -> Callable[[float], None] | None:
        """Submit -> start of a request's work, seconds (engine/stage_figures.py)."""
        return self.serving().on_wait

    @on_wait.setter
    def on_wait(self, hook: Callable[[float], None] | None) -> None:
        self.serving().on_wait = hook

    async def start(self) -> None:
        await self.serving().start()

    def submit(self, request: StageRequest) -> AsyncIterator[StageOutput]:
        return self.serving().submit(request)

    async def abort(self, request_ids: Sequence[str]) -> None:
        await self.serving().abort(request_ids)

    async def close(self) -> None:
        await self.serving().close()

    def batch_size(self, request_id: str) -> int:
        """The most requests a step ran together with ``request_id`` (1 while a one-at-a-time
        request runs; 0: unknown, before or after)."""
        return self.serving().batch_size(request_id)


class BatchingFront(StageFront):
    """:class:`StageFront` of a batching runtime, with its ``on_step`` hook."""

    def serving(self) -> BatchServed:
        raise NotImplementedError

    @property
    def on_step(self) -> Callable[[int], None] | None:
        """Told each step's size (the pool's metrics)."""
        return self.serving().on_step

    @on_step.setter
    def on_step(self, hook: Callable[[int], None] | None) -> None:
        self.serving().on_step = hook
