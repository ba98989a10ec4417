"""Work done ahead of a commit: pause guesses (engine/orchestration/speculation.py) and draft
responses (engine/orchestration/drafts.py), started and dropped as the scheduling policy says
(engine/orchestration/scheduling.py).

The orchestrator hands over the effects of its control plane; this book decides for each
``input.pause`` whether it is transcribed ahead and answered ahead, keeps one draft per
session, and drops drafts when speech resumes, a barge-in or close comes, another session's
real turn needs their stages (by the policy), or the commit does not adopt them.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from duplex_contract.errors import StageError
from duplex_contract.fence import Fence
from duplex_contract.session_events import SessionEvent, UserTranscript
from duplex_contract.tools import ResponseOptions
from engine.duplex.fencing import draft_prefix
from engine.orchestration.drafts import (
    Draft,
    ResponsePlan,
    plan_diff,
    response_plan,
    start_response,
)
from engine.pipeline.pipeline import LlmResult
from engine.tasks import cancelling, reap

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.duplex.effects import Effects
    from engine.duplex.session import DuplexSession
    from engine.orchestration.counters import Counters
    from engine.orchestration.scheduling import Scheduler
    from engine.orchestration.speculation import SpeculativeAsr
    from engine.pipeline.pipeline import Pipeline

log = logging.getLogger(__name__)


class DraftBook:
    """One loop (the orchestrator's). ``drafts``: session id -> its draft."""

    def __init__(
        self,
        config: EngineConfig,
        pipeline: Pipeline,
        scheduler: Scheduler,
        speculation: SpeculativeAsr,
        sessions: Mapping[str, DuplexSession],
        counters: Counters,
        *,
        route_of: Callable[[str], str],
        abort: Callable[[str, str], None],
        track: Callable[[asyncio.Task[Any]], None],
        emit: Callable[[str, SessionEvent], None] | None = None,
    ) -> None:
        self.config = config
        self._emit = emit  # a guess's words, to a session that asked for them
        self.pipeline = pipeline
        self.scheduler = scheduler
        self.speculation = speculation
        self.sessions = sessions
        self.counters = counters
        self._route_of = route_of
        self._abort = abort
        self._track = track
        self.drafts: dict[str, Draft] = {}
        self._ids = itertools.count()
        scheduler.yield_drafts = self.yield_stage

    # ------------------------------------------------------------------ the stages involved
    def _stages(self, sid: str, part: str) -> list[str]:
        try:
            route = self.pipeline.route(self._route_of(sid))
        except StageError:
            return []
        if part == "inputs":
            return [s.name for s in route.inputs]
        responder = [route.responder.name] if route.responder is not None else []
        return responder + [s.name for s in route.outputs]

    def _may_draft(self, sid: str) -> bool:
        return self.scheduler.may_draft(sid, self._stages(sid, "answer"))

    # ------------------------------------------------------------------ pause guesses
    def on_effects(self, effects: Effects) -> None:
        """Guesses to start (``input.pause``, sound after a guess) and to drop (resume)."""
        spec = self.speculation
        for sid, audio, stream_ms in effects.committed:
            spec.committed(sid, audio, stream_ms)  # the context of what the session says next
        for cancel in effects.cancels:
            if cancel.reason == "input_cancelled":  # its queued turns were dropped
                spec.abandon(cancel.session_id)
        for sid in effects.unspeculate:
            spec.resume(sid)
            self.drop(sid)
        speculate = [(f, a, r, False) for f, a, r in effects.speculate]
        guessed = {f.session_id for f, _, _, _ in speculate}
        for sid in dict.fromkeys(s for s, _ in effects.heard):
            # sound the VAD did not call speech followed a pause's guess (a soft last
            # syllable): guess again once it has ended, not only at the commit
            session = self.sessions.get(sid)
            if sid in guessed or session is None or not session.audio:
                continue
            respond = spec.stale_guess(sid, session.audio)
            if respond is not None:
                speculate.append((session.fence, bytes(session.audio), respond, True))
        for fence, audio, respond, again in speculate:
            sid = fence.session_id
            if not self.scheduler.may_guess(sid, self._stages(sid, "inputs")):
                # the policy says a guess (and the draft that would answer it) would delay
                # a real turn: none now, the commit transcribes
                spec.skip(sid, audio)
                self.drop(sid)
                continue
            task = spec.start(fence, audio, respond, again)
            session = self.sessions.get(sid)
            if session is not None and session.guess_words is not None:
                self._send_words(fence, session.guess_words, task)
            if again and sid in self.drafts:
                pass  # the draft of the first guess goes on: the commit adopts it if the
                # words came out the same (a soft tail rarely adds one)
            elif respond:
                self.start(fence, task)
            else:
                self.drop(sid)

    def _send_words(self, fence: Fence, number: int, asr: asyncio.Task[str]) -> None:
        """Once the guess ``asr`` has its words, send them to the session (``input.pause``
        asked with ``words=number``), unless the guess was dropped or failed, or the session
        moved on (speech resumed, the input was committed, it closed)."""
        emit = self._emit
        if emit is None:
            return
        sid = fence.session_id

        def done(task: asyncio.Task[str]) -> None:
            if task.cancelled() or task.exception() is not None:
                return
            session = self.sessions.get(sid)
            if session is None or session.state != "open" or session.guess_words != number:
                return
            emit(sid, UserTranscript(fence=fence, text=task.result(), final=False, guess=number))

        asr.add_done_callback(done)

    # ------------------------------------------------------------------ drafts
    def start(self, fence: Fence, asr: asyncio.Task[str]) -> None:
        """A pause's transcription started: answer it ahead of the commit, unless the
        policy says a draft now would delay a real turn."""
        sid = fence.session_id
        self.drop(sid)
        if not self.config.speculative_response or not self._may_draft(sid):
            return
        draft = Draft(sid, fence.epoch, draft_prefix(sid, fence.epoch, next(self._ids)))
        draft.task = asyncio.create_task(self._run(draft, asr), name=f"draft:{draft.prefix}")
        # a draft that fails unadopted is just dropped: read its exception so asyncio does
        # not log it as never retrieved (an adopting turn gets it from the await)
        draft.task.add_done_callback(reap)
        self.drafts[sid] = draft
        self.counters.drafts["started"] += 1
        self.scheduler.tally.started(draft.prefix)

    async def _run(self, draft: Draft, asr: asyncio.Task[str]) -> LlmResult | None:
        try:
            heard = await asyncio.shield(asr)
            draft.mark("heard")
        except (StageError, asyncio.CancelledError):
            if cancelling():
                raise
            return None  # the guess failed or was dropped: the commit transcribes again
        session = self.sessions.get(draft.session_id)
        if (
            not heard.strip()
            or session is None
            or session.state != "open"
            or session.fence.epoch != draft.epoch
            or not self._may_draft(draft.session_id)  # its own turn may wait for it
        ):
            return None
        draft.plan = response_plan(self.config, session, ResponseOptions(), pending_user=heard)
        return await start_response(
            self.pipeline,
            draft.prefix,
            draft.session_id,
            draft.plan,
            on_text=draft.on_text,
            on_chunk=draft.on_chunk,
            on_call=draft.on_call,
            urgency=draft.urgency,
        )

    def take(self, sid: str, plan: ResponsePlan, prefix: str) -> Draft | None:
        """The session's draft, taken out of the book, when it answers ``plan`` (the
        response of the turn ``prefix``, which adopts it); else it is discarded."""
        draft = self.drafts.pop(sid, None)
        if draft is not None and (draft.plan is None or draft.plan != plan):
            if log.isEnabledFor(logging.INFO):
                why = "not started" if draft.plan is None else plan_diff(draft.plan, plan)
                log.info("speculative response for %s not used: %s", prefix, why)
            self.discard(draft)  # not started yet, or it answers something else
            draft = None
        if draft is not None:
            self.scheduler.tally.ended(draft.prefix, used=True)
        return draft

    def drop(self, sid: str) -> None:
        draft = self.drafts.pop(sid, None)
        if draft is not None:
            self.discard(draft)

    def drop_others(self, sid: str) -> None:
        """A real turn of ``sid`` starts: under a policy that says so, no other session's
        draft may hold a stage it waits for."""
        if self.scheduler.turn_drops_drafts():
            for other in [s for s in self.drafts if s != sid]:
                self.drop(other)

    def yield_stage(self, stage: str, n: int) -> None:
        """``stage`` is full and a real-time request waits: drop ``n`` of the drafts that
        hold it, newest first (counted in ``drafts_yielded``, and as ``dropped``)."""
        ids = self.scheduler.draft_requests(stage)
        holding = [
            d for d in self.drafts.values() if any(r.startswith(d.prefix + "/") for r in ids)
        ]
        holding.sort(key=lambda d: d.created, reverse=True)
        for draft in holding[:n]:
            self.counters.drafts_yielded += 1
            self.drop(draft.session_id)

    def discard(self, draft: Draft) -> None:
        """Stop a draft that will not be adopted: nothing it held is ever sent."""
        draft.discard()
        self.counters.drafts["dropped"] += 1
        self.scheduler.tally.ended(draft.prefix, used=False)
        if draft.task is not None:
            if not draft.task.done():
                draft.task.cancel()
            self._track(draft.task)
            draft.task = None  # (the draft's frame keeps the draft: no cycle through its error)
        self._abort(draft.session_id, f"{draft.prefix}/")

    @property
    def held_bytes(self) -> int:
        return sum(d.held_bytes for d in self.drafts.values())
