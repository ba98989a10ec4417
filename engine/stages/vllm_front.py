"""The stage members of a vLLM-backed stage, passed on to its :class:`VllmEngine` (written
once for the LLM and the talker).

A class sets ``engine`` and writes :meth:`VllmFront.produce` (the coroutine that feeds one
request's outputs on the vLLM loop); it gets ``restarts``, ``health``, ``on_wait``,
``engine_figures``, ``start``, ``submit``, ``abort`` and ``close``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import Any

from engine.messages import StageOutput, StageRequest
from engine.stage_figures import StageEngineFigures
from engine.stages.vllm_engine import VllmEngine
from engine.stages.vllm_loop import RequestStream


class VllmFront:
    """A stage served by one :class:`VllmEngine` (an in-process EngineCore's client)."""

    engine: VllmEngine

    def produce(self, request: StageRequest, stream: RequestStream) -> Coroutine[Any, Any, None]:
        """The coroutine, run on the vLLM loop, that feeds ``request``'s outputs to
        ``stream`` (it raises a StageError for a request it can't serve)."""
        raise NotImplementedError

    @property
    def restarts(self) -> int:
        return self.engine.supervisor.restarts

    def health(self) -> str | None:
        """Why this replica is down (its EngineCore died, or restarting), or None."""
        return self.engine.supervisor.health()

    @property
    def on_wait(self) -> Callable[[float], None] | None:
        """Queue time of each finished request in vLLM's scheduler (engine/stage_figures.py)."""
        return self.engine.figures.on_wait

    @on_wait.setter
    def on_wait(self, hook: Callable[[float], None] | None) -> None:
        self.engine.figures.on_wait = hook

    def engine_figures(self) -> StageEngineFigures:
        return self.engine.figures.snapshot()

    async def start(self) -> None:
        await self.engine.start()

    def submit(self, request: StageRequest) -> AsyncIterator[StageOutput]:
        return self.engine.submit(request, self.produce)

    async def abort(self, request_ids: Sequence[str]) -> None:
        await self.engine.abort(request_ids)

    async def close(self) -> None:
        await self.engine.close()
