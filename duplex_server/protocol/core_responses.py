"""The session core's responses: engine session events become response events; cancels
and barge-ins end a response and advance the epoch (sans-I/O)."""

from __future__ import annotations

from collections.abc import Mapping

from msgspec import UnsetType

from duplex_contract.events import (
    AudioChunk,
    FunctionCallDelta,
    FunctionCallDone,
    ResponseDone,
    ResponseStarted,
    SessionEvent,
    SessionLifecycle,
    TextDelta,
    UserTranscript,
)
from duplex_contract.fence import Fence
from duplex_contract.tools import (
    InputMessage,
    ResponseOptions,
    active_tools,
    tool_result_note,
)
from duplex_server.protocol import events as ev
from duplex_server.protocol.commands import (
    Action,
    Call,
    Cancel,
    CloseSocket,
    PurgeAudio,
    Send,
)
from duplex_server.protocol.config import (
    parse_tool_choice,
    parse_tools,
)
from duplex_server.protocol.core_state import CoreState
from duplex_server.protocol.errors import CloseCode, ProtocolError
from duplex_server.protocol.input import (
    should_interrupt,
)
from duplex_server.protocol.responses import (
    Response,
    audio_events,
    call_delta_events,
    call_done_events,
    finished_events,
    message_events,
    started_events,
    timing_origin,
)
from duplex_server.protocol.usage import response_usage


class CoreResponses(CoreState):
    """Engine events -> server events; response options; cancel and barge-in."""

    def _response_options(
        self, param: ev.ResponseParam | None
    ) -> tuple[ResponseOptions | None, dict[str, str] | None]:
        """A response.create's overrides (validated; nothing is changed on error)."""
        if param is None:
            return None, None
        conversation = param.conversation
        if isinstance(conversation, str) and conversation not in ("auto", "none"):
            raise ProtocolError(
                "unsupported",
                "conversation must be 'auto' or 'none'",
                param="response.conversation",
            )
        modalities = param.output_modalities
        if isinstance(modalities, UnsetType):
            modalities = param.modalities
        mods: tuple[ev.Modality, ...] | None = None
        if not isinstance(modalities, UnsetType):
            if not modalities:
                raise ProtocolError(
                    "invalid_value",
                    "output_modalities is empty",
                    param="response.output_modalities",
                )
            mods = ("audio",) if "audio" in modalities else ("text",)
        max_tokens = param.max_output_tokens
        if isinstance(max_tokens, UnsetType):
            max_tokens = param.max_response_output_tokens
        if isinstance(max_tokens, int) and max_tokens < 1:
            raise ProtocolError(
                "invalid_value",
                "max_output_tokens must be >= 1",
                param="response.max_output_tokens",
            )
        tools = None
        if not isinstance(param.tools, UnsetType):
            tools = parse_tools(param.tools, "response.tools")
        choice, name = None, None
        if not isinstance(param.tool_choice, UnsetType):
            offered = tools if tools is not None else self.config.tools
            choice, name = parse_tool_choice(param.tool_choice, offered, "response.tool_choice")
        messages = None
        if not isinstance(param.input, UnsetType):
            messages = tuple(
                _input_message(item, i, self.items.calls) for i, item in enumerate(param.input)
            )
        options = ResponseOptions(
            instructions=None if isinstance(param.instructions, UnsetType) else param.instructions,
            output_modalities=mods,
            max_output_tokens=max_tokens if isinstance(max_tokens, int) else None,
            temperature=None if isinstance(param.temperature, UnsetType) else param.temperature,
            tools=tools,
            tool_choice=choice,
            tool_name=name,
            conversation="none" if conversation == "none" else "auto",
            input=messages,
        )
        metadata = None if isinstance(param.metadata, UnsetType) else param.metadata
        return options, metadata

    # ------------------------------------------------------------------ cancel / barge-in
    def _cancel(self, kind: str, reason: str, event_id: str | None) -> list[Action]:
        out: list[Action] = []
        old = self.epoch
        self.epoch += 1
        resp = self.responses.cancelled()
        if resp is not None:
            out += self._finish(resp, "cancelled", reason, None)
            out.append(Send(ev.OutputAudioCleared(response_id=resp.id)))
        out.append(PurgeAudio(self.epoch))
        out.append(Call(Cancel(old, kind, event_id=event_id)))  # type: ignore[arg-type]
        return out

    def _maybe_barge_in(self, now_ms: float, speech_ms: float) -> list[Action]:
        """Interrupt the response if ``speech_ms`` of user speech passes the guards (with
        none in progress: clear what the far end still plays, by the same guards)."""
        td = self.config.turn_detection
        if not self.responses.active:
            last = self.responses.last_started
            return self.talk_over.check(td, speech_ms, last_started=last, now_ms=now_ms)
        interrupt = should_interrupt(
            td,
            speech_ms,
            response_active=self.responses.active,
            response_started_ms=self.responses.started_ms,
            now_ms=now_ms,
        )
        return self._cancel("barge_in", "turn_detected", None) if interrupt else []

    # ------------------------------------------------------------------ engine events
    def on_engine_event(self, event: SessionEvent, now_ms: float) -> list[Action]:
        self.now_ms = now_ms
        if isinstance(event, SessionLifecycle):
            return self._lifecycle(event)
        if self.closed or event.fence.epoch < self.epoch:
            return []  # stale: a cancelled epoch's output never becomes an event
        if isinstance(event, AudioChunk):
            cur = self.responses.matching(event.fence)
            if cur is not None:
                cur.moments.setdefault("first_audio", now_ms)
            return self._audio(event)
        if isinstance(event, UserTranscript):
            if event.final:
                self.turn_moments.setdefault("transcript_ready", now_ms)
            if not event.final and event.fence.turn_id >= self.turn_id:
                return self._live_partial(event.text)
            return self.items.transcript(event.fence.turn_id, event.text, event.final)
        if isinstance(event, ResponseStarted):
            return self._start(event.fence, now_ms)
        if isinstance(event, TextDelta):
            resp = self.responses.current
            if resp is None or resp.audio:
                return []
            out = [] if resp.opened else message_events(resp)
            resp.parts.append(event.text)
            delta = ev.TextDelta(response_id=resp.id, item_id=resp.item_id, delta=event.text)
            return [*out, Send(delta)]
        if isinstance(event, FunctionCallDelta):
            resp = self.responses.matching(event.fence)
            if resp is None or resp.opened:
                return []
            return call_delta_events(resp, event.call_id, event.name, event.delta)
        if isinstance(event, FunctionCallDone):
            resp = self.responses.matching(event.fence)
            if resp is None or resp.opened:
                return []
            return call_done_events(resp, event.call_id, event.name, event.arguments)
        assert isinstance(event, ResponseDone)
        resp = self.responses.matching(event.fence)
        if resp is None:
            return []
        if event.timing_ms:
            resp.engine_ms.update(event.timing_ms)
        error = None
        if event.error is not None:
            error = ev.ErrorDetail(
                type="server_error", code=event.error.code, message=event.error.message
            )
        return self._finish(
            resp,
            event.status,
            event.reason,
            error,
            tokens=(event.input_tokens, event.output_tokens),
        )

    def _live_partial(self, text: str) -> list[Action]:
        """A live hypothesis of the speech in progress (engine partials): the words it adds
        to what was already sent go out as a transcription delta of the speech item."""
        item_id = self.input.speech_item
        if item_id is None:
            return []
        sent = self._partials.get(item_id, "")
        if not text.startswith(sent) or len(text) == len(sent):
            return []  # a revised hypothesis: .completed carries the final transcript
        self._partials = {item_id: text}
        return [Send(ev.InputTranscriptDelta(item_id=item_id, delta=text[len(sent) :]))]

    def _lifecycle(self, event: SessionLifecycle) -> list[Action]:
        if event.state == "expiring":
            return [Send(ev.SessionExpiring(in_s=event.in_s or 0.0, reason=event.reason))]
        if self.closed and event.state == "closed":
            return []
        self.closed = True
        out: list[Action] = []
        if event.state == "expired":
            out.append(Send(ev.SessionExpired(reason=event.reason)))
        closed = ev.SessionClosed(reason=event.reason or event.state, usage=self.usage.total())
        out.append(Send(closed))
        out.append(CloseSocket(CloseCode.NORMAL, event.reason or event.state))
        return out

    def _start(self, fence: Fence, now_ms: float) -> list[Action]:
        out: list[Action] = []
        if self.responses.current is not None:  # should not happen: close the old one first
            out += self._finish(self.responses.current, "incomplete", "superseded", None)
        request = self.responses.next_request()
        opts = request.options or ResponseOptions()
        modalities = opts.output_modalities or self.config.output_modalities
        audio = "audio" in modalities
        cfg = self.config
        choice = opts.tool_choice or cfg.tool_choice
        name = opts.tool_name if opts.tool_choice is not None else cfg.tool_name
        tools = active_tools(opts.tools if opts.tools is not None else cfg.tools, choice, name)
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
        resp.moments.update(self.turn_moments)
        resp.moments.setdefault("committed", self.turn_moments.get("speech_stopped", now_ms))
        resp.moments["response_created"] = now_ms
        self.turn_moments = {}
        self.responses.started(resp)
        self.idle_since_ms = None
        if not oob:
            if audio:
                self.items.assistant_audio(resp.item_id, fence.turn_id, fence.response_seq, 0.0)
            self.items.assistant_turn(resp.item_id, fence.turn_id, fence.response_seq)
            resp.previous = self.items.link(resp.item_id)
        out += started_events(resp, list(modalities))
        return out

    def _audio(self, chunk: AudioChunk) -> list[Action]:
        resp = self.responses.matching(chunk.fence)
        if resp is None or not resp.audio:
            return []
        out = [] if resp.opened else message_events(resp)
        data = self.encode_output(chunk.pcm, chunk.sample_rate, self.config.output_format)
        return [*out, *audio_events(resp, chunk, data)]

    def _finish(
        self,
        resp: Response,
        status: str,
        reason: str | None,
        error: ev.ErrorDetail | None,
        *,
        tokens: tuple[int, int] = (0, 0),
    ) -> list[Action]:
        """``tokens``: the LLM's (prompt, generated) tokens (none when cancelled here)."""
        origin = timing_origin(resp)
        self.response_origin.clear()
        if origin is not None:
            self.response_origin[resp.id] = origin
        self.responses.ended()
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
        self.idle_since_ms = self.now_ms + resp.audio_ms
        return out


def _input_message(item: ev.ItemParam, i: int, calls: Mapping[str, str]) -> InputMessage:
    """One item of an out-of-band response's ``input``."""
    where = f"response.input.{i}"
    if item.type == "function_call_output":
        if not isinstance(item.call_id, str) or item.call_id not in calls:
            raise ProtocolError("invalid_value", "unknown call_id", param=f"{where}.call_id")
        output = item.output if isinstance(item.output, str) else ""
        text = tool_result_note(calls[item.call_id], None, output)
        return InputMessage(role="system", content=text)
    if item.type != "message":
        raise ProtocolError(
            "unsupported", "input items are messages or function_call_output", param=f"{where}.type"
        )
    texts: list[str] = []
    for j, part in enumerate(item.content):
        piece = part.text if isinstance(part.text, str) else part.transcript
        if not isinstance(piece, str):
            raise ProtocolError(
                "unsupported", "input content must be text", param=f"{where}.content.{j}"
            )
        texts.append(piece)
    return InputMessage(role=item.role, content=" ".join(t for t in texts if t))
