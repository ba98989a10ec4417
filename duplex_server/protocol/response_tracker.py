"""The session's responses (sans-I/O): engine output becomes the response lifecycle's
events; ``response.create`` / ``response.cancel``, cancels and the barge-in decision.

:class:`ResponseTracker` holds the lifecycle (:class:`~duplex_server.protocol.responses.
Responses`: the response in progress and the requested ones) and is given what it shares
with the rest of the session: the engine position (a cancel advances the epoch), the
conversation, the usage meter, the turn timeline and the playout state. The event builders
it calls live in :mod:`~duplex_server.protocol.responses`.

Cancel: the response in progress ends (``response.done{cancelled}`` and
``output_audio_buffer.cleared``), the epoch advances at once so that output of the old
epoch is dropped before it becomes an event, queued audio below the new epoch is purged
(:class:`PurgeAudio`) and the engine is told (:class:`Cancel`, at the old epoch).
"""

from __future__ import annotations

from duplex_contract.control import PlaybackMark
from duplex_contract.fence import Fence
from duplex_contract.session_events import (
    AudioChunk,
    FunctionCallDelta,
    FunctionCallDone,
    ResponseDone,
    ResponseStarted,
    TextDelta,
)
from duplex_contract.tools import ResponseOptions, active_tools
from duplex_server.protocol import events as ev
from duplex_server.protocol.commands import (
    Action,
    Call,
    Cancel,
    Commit,
    PurgeAudio,
    Resync,
    Send,
    Touch,
)
from duplex_server.protocol.errors import ProtocolError
from duplex_server.protocol.input import should_interrupt
from duplex_server.protocol.items import Conversation
from duplex_server.protocol.playout import Playout
from duplex_server.protocol.position import EnginePosition
from duplex_server.protocol.response_options import response_options
from duplex_server.protocol.responses import (
    Requested,
    Response,
    Responses,
    audio_events,
    call_delta_events,
    call_done_events,
    finished_events,
    message_events,
    started_events,
    timing_origin,
)
from duplex_server.protocol.session_config import EffectiveSession
from duplex_server.protocol.timeline import TurnTimeline
from duplex_server.protocol.usage import UsageMeter, response_usage

#: client events about responses and the audio of their items
ResponseEvent = (
    ev.ResponseCreate
    | ev.ResponseCancel
    | ev.OutputAudioBufferClear
    | ev.BargeIn
    | ev.ConversationItemTruncate
    | ev.PlaybackAck
)
#: engine session events of a response
ResponseOutput = (
    AudioChunk | ResponseStarted | TextDelta | FunctionCallDelta | FunctionCallDone | ResponseDone
)


class ResponseTracker:
    """One session's responses: requested, started, streamed, finished or cancelled."""

    def __init__(
        self,
        position: EnginePosition,
        items: Conversation,
        usage: UsageMeter,
        timeline: TurnTimeline,
        playout: Playout,
    ) -> None:
        self.position = position
        self.items = items
        self.usage = usage
        self.timeline = timeline
        self.playout = playout
        self.lifecycle = Responses()
        #: response id -> its timeline's origin (the transport adds the write moment)
        self.origin: dict[str, float] = {}

    @property
    def active(self) -> bool:
        """A response is in progress or requested."""
        return self.lifecycle.active

    @property
    def current(self) -> Response | None:
        return self.lifecycle.current

    def requested(self, request: Requested | None = None) -> None:
        """A commit asked the engine for a response (it starts with ``ResponseStarted``)."""
        self.lifecycle.requested(request)

    def request_failed(self) -> None:
        self.lifecycle.request_failed()

    # ------------------------------------------------------------------ client events
    def on_client_event(
        self, e: ResponseEvent, config: EffectiveSession, now_ms: float
    ) -> list[Action]:
        """Raises :class:`ProtocolError` (nothing changed) for what cannot be done."""
        if isinstance(e, ev.ResponseCreate):
            return self._create(e, config)
        if isinstance(e, ev.ResponseCancel):
            current = self.lifecycle.current
            if not self.active or (
                e.response_id is not None and (current is None or current.id != e.response_id)
            ):
                raise ProtocolError(
                    "response_cancel_not_active",
                    "no such response in progress",
                    param="response_id",
                )
            return self.cancel("response.cancel", "client_cancelled", e.event_id, now_ms)
        if isinstance(e, ev.OutputAudioBufferClear):
            if self.active:
                return self.cancel("response.cancel", "client_cancelled", e.event_id, now_ms)
            return [Send(ev.OutputAudioCleared(response_id=None))]
        if isinstance(e, ev.BargeIn):
            if not self.active:
                return []
            return self.cancel("barge_in", "turn_detected", e.event_id, now_ms)
        if isinstance(e, ev.ConversationItemTruncate):
            return self.heard(e.item_id, float(e.audio_end_ms), e.event_id, truncate=True)
        return self.heard(e.item_id, e.played_ms, e.event_id, truncate=False)

    def _create(self, e: ev.ResponseCreate, config: EffectiveSession) -> list[Action]:
        if config.session_type == "transcription":
            raise ProtocolError(
                "invalid_state", "a transcription session has no responses", param="type"
            )
        if self.active:
            raise ProtocolError(
                "conversation_already_has_active_response",
                "a response is in progress; cancel it first",
            )
        options, metadata = response_options(e.response, config.tools, self.items.calls)
        self.lifecycle.requested(Requested(options, metadata))
        self.usage.committed()  # the engine commits its input buffer with the response
        commit = Commit(self.position.epoch, respond=True, event_id=e.event_id, response=options)
        return [Call(commit)]

    def heard(
        self, item_id: str, played_ms: float, event_id: str | None, *, truncate: bool
    ) -> list[Action]:
        """The user heard ``item_id``'s audio through ``played_ms`` (clamped to the audio
        sent): ``truncate`` cuts the item there (``conversation.item.truncated``), else it
        is acknowledged (``playback.acknowledged``)."""
        rec = self.items.assistant_record(item_id)
        if rec is None:
            raise ProtocolError(
                "item_not_found", f"no assistant audio item {item_id}", param="item_id"
            )
        turn, resp, sent_ms = rec
        current = self.lifecycle.current
        if current is not None and current.item_id == item_id:
            sent_ms = current.audio_ms
        applied = min(played_ms, sent_ms)
        mark = PlaybackMark(turn, resp, applied, truncate)
        touch = Touch(self.position.epoch, "playback_ack", mark, event_id=event_id)
        if truncate:
            event: ev.ServerEvent = ev.ItemTruncated(
                item_id=item_id,
                content_index=0,
                audio_end_ms=int(applied),
                requested_audio_end_ms=int(played_ms),
            )
        else:
            event = ev.PlaybackAcknowledged(
                item_id=item_id, played_ms=applied, requested_played_ms=played_ms
            )
        return [Call(touch), Send(event)]

    # ------------------------------------------------------------------ cancel / barge-in
    def cancel(self, kind: str, reason: str, event_id: str | None, now_ms: float) -> list[Action]:
        """End the response in progress (and drop the requested ones) and advance the
        epoch; ``kind``: the engine's cancel event, ``reason``: ``response.done``'s."""
        out: list[Action] = []
        old = self.position.advance()
        self.playout.drop_held()  # audio held by a pause is of the old epoch
        resp = self.lifecycle.cancelled()
        if resp is not None:
            out += self._finish(resp, "cancelled", reason, None, now_ms)
            out.append(Send(ev.OutputAudioCleared(response_id=resp.id)))
        out.append(PurgeAudio(self.position.epoch))
        out.append(Call(Cancel(old, kind, event_id=event_id)))  # type: ignore[arg-type]
        return out

    def engine_restarted(
        self, dropped: Fence | None, config: EffectiveSession, now_ms: float
    ) -> list[Action]:
        """The engine restarted and took the session back (docs/scale.md). The answer that
        was running is gone (``dropped``: its fence): the response in progress ends (the
        client is told ``session.resync_required{engine_restarted}``, then
        ``response.done{cancelled, engine_restarted}``; one whose start never arrived is
        started first) and the engine is told to drop the rest, as a cancel does. Answers
        asked for and not started are answered by the restarted engine; a session with no
        answer running never notices."""
        out: list[Action] = []
        if self.lifecycle.current is None:
            if dropped is None or not self.lifecycle.queue:
                return []
            out = self._start(dropped, config, now_ms)  # its ResponseStarted was lost
        cancel = self.cancel("response.cancel", "engine_restarted", None, now_ms)
        return [Resync("engine_restarted"), *out, *cancel]

    def barge_in(
        self, td: ev.TurnDetection | None, speech_ms: float, now_ms: float
    ) -> list[Action]:
        """Interrupt the response if ``speech_ms`` of user speech passes the guards (with
        none in progress: clear what the far end still plays, by the same guards)."""
        if not self.active:
            last = self.lifecycle.last_started
            return self.playout.talk_over(td, speech_ms, last_started=last, now_ms=now_ms)
        interrupt = should_interrupt(
            td,
            speech_ms,
            response_active=True,
            response_started_ms=self.lifecycle.started_ms,
            now_ms=now_ms,
        )
        return self.cancel("barge_in", "turn_detected", None, now_ms) if interrupt else []

    # ------------------------------------------------------------------ engine events
    def on_engine_event(
        self, event: ResponseOutput, config: EffectiveSession, now_ms: float
    ) -> list[Action]:
        """Output of the current epoch (the caller drops stale output) -> events."""
        if isinstance(event, AudioChunk):
            resp = self.lifecycle.matching(event.fence)
            if resp is None:
                return []
            resp.moments.setdefault("first_audio", now_ms)
            if not resp.audio:
                return []
            out = [] if resp.opened else message_events(resp)
            audio, transcript = audio_events(resp, event)
            return [*out, *self.playout.emit(audio, now_ms), transcript]
        if isinstance(event, ResponseStarted):
            return self._start(event.fence, config, now_ms)
        if isinstance(event, TextDelta):
            resp = self.lifecycle.current
            if resp is None or resp.audio:
                return []
            out = [] if resp.opened else message_events(resp)
            resp.parts.append(event.text)
            delta = ev.TextDelta(response_id=resp.id, item_id=resp.item_id, delta=event.text)
            return [*out, Send(delta)]
        resp = self.lifecycle.matching(event.fence)
        if isinstance(event, FunctionCallDelta):
            if resp is None or resp.opened:
                return []
            return call_delta_events(resp, event.call_id, event.name, event.delta)
        if isinstance(event, FunctionCallDone):
            if resp is None or resp.opened:
                return []
            return call_done_events(resp, event.call_id, event.name, event.arguments)
        if resp is None:
            return []
        if event.timing_ms:
            resp.engine_ms.update(event.timing_ms)
        error = None
        if event.error is not None:
            error = ev.ErrorDetail(
                type="server_error", code=event.error.code, message=event.error.message
            )
        tokens = (event.input_tokens, event.output_tokens)
        return self._finish(resp, event.status, event.reason, error, now_ms, tokens=tokens)

    def _start(self, fence: Fence, config: EffectiveSession, now_ms: float) -> list[Action]:
        out: list[Action] = []
        if self.lifecycle.current is not None:  # should not happen: close the old one first
            out += self._finish(self.lifecycle.current, "incomplete", "superseded", None, now_ms)
        request = self.lifecycle.next_request()
        opts = request.options or ResponseOptions()
        modalities = opts.output_modalities or config.output_modalities
        audio = "audio" in modalities
        choice = opts.tool_choice or config.tool_choice
        name = opts.tool_name if opts.tool_choice is not None else config.tool_name
        tools = active_tools(opts.tools if opts.tools is not None else config.tools, choice, name)
        oob = opts.conversation == "none"
        resp = Response(
            id=self.items.new_id("resp"),
            item_id=self.items.new_id("item"),
            fence=fence,
            started_ms=now_ms,
            audio=audio,
            deferred=bool(tools),
            oob=oob,
            metadata=request.metadata,
            input_audio_ms=0.0 if oob else self.usage.answered(),
        )
        moments = self.timeline.take_moments()
        resp.moments.update(moments)
        resp.moments.setdefault("committed", moments.get("speech_stopped", now_ms))
        resp.moments["response_created"] = now_ms
        self.lifecycle.started(resp)
        self.timeline.silence_broken()
        if not oob:
            if audio:
                self.items.assistant_audio(resp.item_id, fence.turn_id, fence.response_seq, 0.0)
            self.items.assistant_turn(resp.item_id, fence.turn_id, fence.response_seq)
            resp.previous = self.items.link(resp.item_id)
        out += started_events(resp, list(modalities))
        return out

    def _finish(
        self,
        resp: Response,
        status: str,
        reason: str | None,
        error: ev.ErrorDetail | None,
        now_ms: float,
        *,
        tokens: tuple[int, int] = (0, 0),
    ) -> list[Action]:
        """``tokens``: the LLM's (prompt, generated) tokens (none when cancelled here)."""
        origin = timing_origin(resp)
        self.origin.clear()
        if origin is not None:
            self.origin[resp.id] = origin
        self.lifecycle.ended()
        if resp.audio and not resp.oob:
            f = resp.fence
            self.items.assistant_audio(resp.item_id, f.turn_id, f.response_seq, resp.audio_ms)
        modalities = ["audio"] if resp.audio else ["text"]
        usage = response_usage(
            input_text=tokens[0],
            output_text=tokens[1],
            input_audio_ms=resp.input_audio_ms,
            output_audio_ms=resp.audio_ms,
        )
        self.usage.add(usage)
        item, out = finished_events(resp, status, reason, error, usage, modalities)  # type: ignore[arg-type]
        if item is not None and not resp.oob:
            self.items.remember(item)
        # idle timeout: the silence is counted from the end of the reply's audio
        self.timeline.answer_ended(now_ms + resp.audio_ms)
        return out
