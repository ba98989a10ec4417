"""Speculative ASR: transcribe when the VAD sees a pause begin, before the turn ends.

The server signals ``input.pause`` once a short silence starts inside speech; the
transcript of the input so far is then usually ready when the silence window ends the
turn. The commit uses it when its audio starts with exactly the speculated audio (only
silence was appended since) and the epoch is unchanged; ``input.resume``, a cancel or a
mismatch drops it. Runs on the orchestrator loop; the ASR itself runs in its stage.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.errors import StageError
from engine.messages import Fence
from engine.pipeline import Pipeline

log = logging.getLogger(__name__)


@dataclass
class _Speculation:
    fence: Fence
    audio: bytes
    task: asyncio.Task[str]


class SpeculativeAsr:
    def __init__(
        self, pipeline: Pipeline, sample_rate: int, track: Callable[[asyncio.Task[Any]], None]
    ) -> None:
        self._pipeline = pipeline
        self._rate = sample_rate
        self._track = track  # the orchestrator awaits dropped tasks at shutdown
        self._specs: dict[str, _Speculation] = {}
        self.started = 0
        self.used = 0

    def start(self, fence: Fence, audio: bytes) -> None:
        sid = fence.session_id
        self.drop(sid)
        task = asyncio.create_task(
            self._pipeline.transcribe(
                f"{fence.key()}/asr-spec{len(audio)}",
                audio,
                sample_rate=self._rate,
                session_id=sid,
            ),
            name=f"speculate:{sid}",
        )
        self._specs[sid] = _Speculation(fence, audio, task)
        self.started += 1

    def drop(self, session_id: str) -> None:
        spec = self._specs.pop(session_id, None)
        if spec is not None:
            spec.task.cancel()
            self._track(spec.task)

    async def transcript(self, fence: Fence, audio: bytes) -> str:
        """The transcript of a committed turn: the speculation's if it covers it, else ASR."""
        sid = fence.session_id
        spec = self._specs.pop(sid, None)
        if spec is not None and spec.fence.epoch == fence.epoch and audio.startswith(spec.audio):
            try:
                text = await spec.task
                self.used += 1
                return text
            except StageError:
                log.info("speculative ASR failed for %s; transcribing again", sid)
        elif spec is not None:
            spec.task.cancel()
            self._track(spec.task)
        return await self._pipeline.transcribe(
            f"{fence.key()}/asr", audio, sample_rate=self._rate, session_id=sid
        )

    def tasks(self) -> list[asyncio.Task[str]]:
        return [s.task for s in self._specs.values()]
