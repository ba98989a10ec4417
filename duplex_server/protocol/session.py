"""The per-session protocol state machine (sans-I/O).

:class:`SessionCore` takes parsed client events, processed input audio (with VAD
decisions), engine session events and engine call results, each with the current time in
milliseconds passed in, and returns :mod:`~duplex_server.protocol.commands` actions: server
events to send, engine calls to make, local actions. It never awaits, never touches a
socket and never reads the clock. The session runtime (``duplex_server.session_runtime``)
executes actions in order and makes no protocol decisions of its own; that includes
opening, resuming and taking a session over and ending it for a slow client, all decided
here. Its parts: :mod:`~duplex_server.protocol.items` (conversation items),
:mod:`~duplex_server.protocol.responses` (the response lifecycle and its events) and
:mod:`~duplex_server.protocol.input` (input turns; VAD decisions arrive as
:mod:`~duplex_server.protocol.vad` events).

Epochs: every cancel the core decides advances ``epoch`` at once (the engine accepts exactly
one epoch step per cancel), so output of an older epoch is dropped here before it becomes an
event, queued audio below the epoch is purged (:class:`PurgeAudio`), and the writer checks
:attr:`SessionCore.epoch` again before each audio frame.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence

from msgspec import UnsetType

from duplex_contract.audio import input_ms
from duplex_contract.errors import ControlError
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
from duplex_contract.fence import Fence, resume_query
from duplex_contract.tools import (
    InputMessage,
    ItemRef,
    ResponseOptions,
    ToolOutput,
    active_tools,
    tool_result_note,
)
from duplex_server.protocol import dtmf
from duplex_server.protocol import events as ev
from duplex_server.protocol.codec import AudioFormat, decode_audio_b64
from duplex_server.protocol.commands import (
    AckJournal,
    Action,
    Append,
    Call,
    Cancel,
    CloseSession,
    CloseSocket,
    Commit,
    ConfigureInput,
    DeleteItem,
    DropOutput,
    EngineCommand,
    ProcessAudio,
    PurgeAudio,
    Release,
    Replay,
    Send,
    SendStamped,
    Speculate,
    Takeover,
    Touch,
    Update,
)
from duplex_server.protocol.config import (
    EffectiveSession,
    apply_patch,
    parse_tool_choice,
    parse_tools,
)
from duplex_server.protocol.errors import CloseCode, ProtocolError, SessionFatal, to_wire_error
from duplex_server.protocol.input import (
    AudioReady,
    InputTurns,
    Paused,
    Resumed,
    Speaking,
    SpeechBegan,
    SpeechEnded,
    TurnStep,
    should_interrupt,
)
from duplex_server.protocol.items import Conversation, user_text
from duplex_server.protocol.playout import TalkOver
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
from duplex_server.protocol.resume import token_matches
from duplex_server.protocol.usage import UsageMeter, response_usage
from duplex_server.protocol.vad import VadEvent

log = logging.getLogger(__name__)


def _identity(pcm: bytes, rate: int, fmt: AudioFormat) -> bytes:
    return pcm


class SessionCore:
    """One session's protocol state; survives socket changes (resume, takeover).

    Three parts, each testable alone: :attr:`items` (the conversation),
    :attr:`responses` (the response lifecycle) and :attr:`input` (input turns: VAD and
    the prefix ring). The core owns what joins them: the epoch, the engine's turn and
    response counters, and the dispatch of client and engine events.
    """

    def __init__(
        self,
        session_id: str,
        config: EffectiveSession,
        *,
        lease_generation: int = 1,
        encode_output: Callable[[bytes, int, AudioFormat], bytes] = _identity,
    ) -> None:
        self.session_id = session_id
        self.config = config
        self.lease_generation = lease_generation
        self.epoch = 0
        self.turn_id = 0
        #: moments (ms, the caller's clock) of the turn being answered: response.done timing
        self.turn_moments: dict[str, float] = {}
        #: response id -> its timeline's origin (the transport adds the write moment)
        self.response_origin: dict[str, float] = {}
        self.response_seq = 0
        self.closed = False
        self.encode_output = encode_output
        self.token_hash = b""  # digest of the current resume token
        self._new_token = ""
        self.resuming = False  # a resume is waiting for the engine
        self.items = Conversation(session_id)
        self.now_ms = 0.0  # the time of the latest input (for the idle timeout)
        #: idle timeout: silence since (ms); None = not armed (fires once per silence)
        self.idle_since_ms: float | None = None
        self._partials: dict[str, str] = {}  # speech item -> live transcript sent so far
        self.responses = Responses()
        #: audio a media transport's far end still plays after its response ended
        self.talk_over = TalkOver()
        self.usage = UsageMeter()  # tokens and audio seconds (response.done, session.closed)
        # not a lambda over self: a reference cycle would keep a closed session until the
        # cyclic GC ran
        self.input = InputTurns(functools.partial(self.items.new_id, "item"))

    # ------------------------------------------------------------------ positions
    @property
    def position(self) -> Fence:
        return Fence(self.session_id, self.epoch, self.turn_id, self.response_seq)

    def fence_for(self, epoch: int) -> Fence:
        """The fence an engine call decided at ``epoch`` carries when it is executed."""
        return Fence(self.session_id, epoch, self.turn_id, self.response_seq)

    @property
    def response_active(self) -> bool:
        return self.responses.active

    @property
    def beta(self) -> bool:
        return self.config.event_names == "beta"

    # ------------------------------------------------------------------ attachments
    def opened(
        self, resume_token: str, capabilities: ev.Capabilities, *, token_hash: bytes = b""
    ) -> list[Action]:
        """The session was opened for its first transport."""
        self.token_hash = token_hash
        return [
            Send(
                ev.SessionCreated(
                    session=self.config.to_wire(self.session_id),
                    resume_token=resume_token,
                    capabilities=capabilities,
                    resume_query=resume_query(self.session_id),
                )
            ),
            ConfigureInput(
                self.config.input_format, self.config.turn_detection, self.config.noise_reduction
            ),
        ]

    def admit_resume(self, token: str) -> None:
        """May a new transport resume this session? Raises :class:`SessionFatal` if not;
        else the session is resuming until :meth:`resumed` or :meth:`resume_failed`."""
        if self.closed:
            raise SessionFatal("session_not_found", f"no live session {self.session_id}")
        if not token_matches(token, self.token_hash):
            raise SessionFatal("invalid_resume_token", "the resume token does not match")
        if self.resuming:
            raise SessionFatal("stale_lease", "another resume of this session is in progress")
        self.resuming = True

    def resume_failed(self) -> None:
        self.resuming = False

    def resumed(
        self,
        lease_generation: int,
        token: str,
        token_hash: bytes,
        *,
        after_seq: int,
        attached: bool,
    ) -> list[Action]:
        """The engine renewed the lease: the new transport takes over (the old one, if
        ``attached``, is replaced) and is sent what it missed after ``after_seq``."""
        self.resuming = False
        self.lease_generation = lease_generation
        self.token_hash = token_hash
        self._new_token = token
        return [*([Takeover()] if attached else []), Replay(after_seq)]

    def replayed(
        self, frames: list[bytes] | None, first_available: int, last_seq: int
    ) -> list[Action]:
        """What the journal had after the resume point (``None``: some of it was lost)."""
        out: list[Action] = []
        if frames is None:
            reason = "events after the given seq are no longer journaled"
            resync = ev.ResyncRequired(
                reason=reason, first_available_seq=first_available, last_seq=last_seq
            )
            out.append(Send(resync))
        elif frames:
            out.append(SendStamped(tuple(frames)))
        resumed = ev.SessionResumed(
            session_id=self.session_id,
            resume_token=self._new_token,
            replayed=0 if frames is None else len(frames),
            lease_generation=self.lease_generation,
        )
        out.append(Send(resumed))
        return out

    def too_slow(self) -> list[Action]:
        """The client does not read its output fast enough: the session ends."""
        if self.closed:
            return []
        fatal = SessionFatal("client_too_slow", "the client reads too slowly")
        return [DropOutput(), *self.error(fatal), *self.close("client_too_slow"), Release()]

    def input_refused(self) -> list[Action]:
        """The transport's input backlog is full: this audio was dropped."""
        return self.error(
            ProtocolError(
                "input_backpressure",
                "input audio backlog is full; the audio was dropped (send slower)",
                error_type="rate_limit_error",
            )
        )

    def input_failed(self) -> list[Action]:
        """Processing this session's input failed (a bug, logged by the caller)."""
        return [*self.error(RuntimeError()), CloseSocket(CloseCode.INTERNAL, "server_error")]

    def audio_received(self, nbytes: int) -> None:
        """The transport handed the session ``nbytes`` of input audio (its input format)."""
        self.usage.received(self.config.input_format.duration_ms(nbytes))

    def on_dtmf(self, digit: str, received_at: int, now_ms: float) -> list[Action]:
        """A keypad digit from a phone transport (:mod:`~duplex_server.protocol.dtmf`)."""
        if self.closed:
            return []
        self.now_ms = now_ms
        speaking = self.input.speech_item is not None
        p = dtmf.plan(self.config, speaking=speaking, response_active=self.responses.active)
        item_id = self.items.new_id("item") if p.as_item else None
        out: list[Action] = [
            Send(ev.DtmfEventReceived(event=digit, received_at=received_at, item_id=item_id))
        ]
        if item_id is None:
            return out
        if p.interrupt:
            out += self._cancel("barge_in", "turn_detected", None)
        text = dtmf.dtmf_text(digit)
        self.input.uncommitted_text = True
        out += [Call(Append(self.epoch, text=text, item_id=item_id))]
        out += self.items.user_text(item_id, text)
        if p.respond:  # no speech in progress: the engine's input holds this text only
            self.input.committed()
            self.usage.committed()
            self.responses.requested()
            out.append(Call(Commit(self.epoch, respond=True)))
        return out

    # ------------------------------------------------------------------ client events
    def on_client_event(self, event: ev.AnyClientEvent, now_ms: float) -> list[Action]:
        if self.closed:
            return []
        try:
            return self._dispatch(event, now_ms)
        except ProtocolError as exc:
            return self.error(exc, event.event_id)

    def error(self, exc: BaseException, event_id: str | None = None) -> list[Action]:
        """The one place an exception becomes actions: the error event, maybe a close."""
        detail, close = to_wire_error(exc, event_id=event_id)
        out: list[Action] = [Send(ev.Error(error=detail))]
        if close is not None:
            out.append(CloseSocket(close, detail.code))
        return out

    def _dispatch(self, e: ev.AnyClientEvent, now_ms: float) -> list[Action]:
        self.now_ms = now_ms
        if isinstance(e, ev.InputAudioBufferAppend):
            data = decode_audio_b64(e.audio)
            return [ProcessAudio(data)] if data else []
        if isinstance(e, ev.SessionUpdate):
            return self._update(e)
        if isinstance(e, ev.InputAudioBufferCommit):
            return self._commit_input(e.event_id)
        if isinstance(e, ev.InputAudioBufferClear):
            return self._clear_input(e.event_id)
        if isinstance(e, ev.ConversationItemCreate):
            return self._create_item(e)
        if isinstance(e, ev.ResponseCreate):
            if self.config.session_type == "transcription":
                raise ProtocolError(
                    "invalid_state", "a transcription session has no responses", param="type"
                )
            if self.responses.active:
                raise ProtocolError(
                    "conversation_already_has_active_response",
                    "a response is in progress; cancel it first",
                )
            options, metadata = self._response_options(e.response)
            self.responses.requested(Requested(options, metadata))
            self.usage.committed()  # the engine commits its input buffer with the response
            commit = Commit(self.epoch, respond=True, event_id=e.event_id, response=options)
            return [Call(commit)]
        if isinstance(e, ev.ResponseCancel):
            current = self.responses.current
            if not self.responses.active or (
                e.response_id is not None and (current is None or current.id != e.response_id)
            ):
                raise ProtocolError(
                    "response_cancel_not_active",
                    "no such response in progress",
                    param="response_id",
                )
            return self._cancel("response.cancel", "client_cancelled", e.event_id)
        if isinstance(e, ev.OutputAudioBufferClear):
            if self.responses.active:
                return self._cancel("response.cancel", "client_cancelled", e.event_id)
            return [Send(ev.OutputAudioCleared(response_id=None))]
        if isinstance(e, ev.BargeIn):
            return (
                self._cancel("barge_in", "turn_detected", e.event_id)
                if self.responses.active
                else []
            )
        if isinstance(e, ev.ConversationItemTruncate):
            return self._truncate(e.item_id, float(e.audio_end_ms), e.event_id, truncate=True)
        if isinstance(e, ev.PlaybackAck):
            return self._truncate(e.item_id, e.played_ms, e.event_id, truncate=False)
        if isinstance(e, ev.ConversationItemRetrieve):
            item = self.items.get(e.item_id)
            if item is None:
                raise ProtocolError("item_not_found", f"no item {e.item_id}", param="item_id")
            return [Send(ev.ItemRetrieved(item=item))]
        if isinstance(e, ev.ConversationItemDelete):
            return self._delete_item(e.item_id, e.event_id)
        if isinstance(e, ev.SessionHeartbeat):
            return [Call(Touch(self.epoch, "heartbeat")), Send(ev.HeartbeatAck())]
        if isinstance(e, ev.SessionEventAck):
            return [AckJournal(e.seq)]
        if isinstance(e, ev.SessionClose):
            return self.close("client")
        assert isinstance(e, ev.SessionResume)
        raise ProtocolError(
            "invalid_state",
            "session.resume must be the first event of a new connection (?intent=resume)",
        )

    def close(self, reason: str) -> list[Action]:
        if self.closed:
            return []
        self.closed = True
        return [
            Call(CloseSession(reason)),
            Send(ev.SessionClosed(reason=reason, usage=self.usage.total())),
            CloseSocket(CloseCode.NORMAL, reason),
        ]

    def _update(self, e: ev.SessionUpdate) -> list[Action]:
        old = self.config
        new = apply_patch(old, e.session)
        self.config = new
        out: list[Action] = []
        if new.settings() != old.settings():
            out.append(Call(Update(self.epoch, new.settings(), event_id=e.event_id)))
        if (
            new.input_format != old.input_format
            or new.turn_detection != old.turn_detection
            or new.noise_reduction != old.noise_reduction
        ):
            self.input.reset()
            out.append(ConfigureInput(new.input_format, new.turn_detection, new.noise_reduction))
        out.append(Send(ev.SessionUpdated(session=new.to_wire(self.session_id))))
        return out

    def _commit_input(self, event_id: str | None) -> list[Action]:
        if not self.input.buffered:
            raise ProtocolError(
                "input_audio_buffer_commit_empty", "the input audio buffer is empty"
            )
        out = self._steps(self.input.flush(), 0.0)
        item_id = self.input.take_speech_item() or self.items.new_id("item")
        out += self._commit_user_audio(item_id, respond=False, event_id=event_id)
        return out

    def _commit_user_audio(
        self, item_id: str, *, respond: bool, event_id: str | None
    ) -> list[Action]:
        self.input.committed()
        self.usage.committed()
        if respond:
            self.responses.requested()
        call = Call(Commit(self.epoch, respond=respond, event_id=event_id, item_id=item_id))
        return [call, *self.items.user_audio(item_id)]

    def _clear_input(self, event_id: str | None) -> list[Action]:
        out: list[Action] = []
        self.input.reset()
        if self.input.uncommitted_ms > 0 or self.input.uncommitted_text:
            # The engine's input.cancel also drops the work of the current epoch.
            out += self._cancel("input.cancel", "input_cancelled", event_id)
            self.input.committed()
            self.usage.cleared()
        out.append(Send(ev.InputCleared()))
        return out

    def _create_item(self, e: ev.ConversationItemCreate) -> list[Action]:
        item_id = e.item.id if isinstance(e.item.id, str) else None
        if item_id is not None and self.items.get(item_id) is not None:
            raise ProtocolError("invalid_value", f"item {item_id} exists", param="item.id")
        if e.item.type == "function_call_output":
            return self._tool_output(e.item, item_id, e.event_id)
        if e.item.type != "message":
            raise ProtocolError(
                "unsupported",
                "items of this type cannot be created (message, function_call_output)",
                param="item.type",
            )
        text = user_text(e.item)  # raises ProtocolError for what cannot be created
        self.input.uncommitted_text = True
        item_id = item_id if item_id is not None else self.items.new_id("item")
        return [
            Call(Append(self.epoch, text=text, event_id=e.event_id, item_id=item_id)),
            *self.items.user_text(item_id, text),
        ]

    def _tool_output(
        self, item: ev.ItemParam, item_id: str | None, event_id: str | None
    ) -> list[Action]:
        """A function's result: into the engine's history with the next commit."""
        if not isinstance(item.call_id, str):
            raise ProtocolError("invalid_event", "call_id is required", param="item.call_id")
        if not isinstance(item.output, str):
            raise ProtocolError("invalid_event", "output is required", param="item.output")
        name = self.items.calls.get(item.call_id)
        if name is None:
            raise ProtocolError(
                "invalid_value",
                f"no function call {item.call_id} in this conversation",
                param="item.call_id",
            )
        item_id = item_id if item_id is not None else self.items.new_id("item")
        self.input.uncommitted_text = True
        output = ToolOutput(call_id=item.call_id, name=name, output=item.output, item_id=item_id)
        return [
            Call(Append(self.epoch, event_id=event_id, item_id=item_id, tool_output=output)),
            *self.items.tool_output(item_id, item.call_id, item.output),
        ]

    def _delete_item(self, item_id: str, event_id: str | None) -> list[Action]:
        item = self.items.get(item_id)
        if item is None:
            raise ProtocolError("item_not_found", f"no item {item_id}", param="item_id")
        current = self.responses.current
        if current is not None and current.item_id == item_id:
            raise ProtocolError(
                "invalid_state",
                "the item of the response in progress cannot be deleted (cancel it first)",
                param="item_id",
            )
        turn = self.items.turn_of(item_id)
        ref = (
            ItemRef(item_id=item_id)
            if turn is None
            else ItemRef(turn_id=turn[0], response_seq=turn[1])
        )
        self.items.forget(item_id)
        return [
            Call(DeleteItem(self.epoch, ref, event_id=event_id)),
            Send(ev.ItemDeleted(item_id=item_id)),
        ]

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

    def _truncate(
        self, item_id: str, played_ms: float, event_id: str | None, *, truncate: bool
    ) -> list[Action]:
        rec = self.items.assistant_record(item_id)
        if rec is None:
            raise ProtocolError(
                "item_not_found", f"no assistant audio item {item_id}", param="item_id"
            )
        turn, resp, sent_ms = rec
        current = self.responses.current
        if current is not None and current.item_id == item_id:
            sent_ms = current.audio_ms
        applied = min(played_ms, sent_ms)
        touch = Touch(
            self.epoch,
            "playback_ack",
            turn_id=turn,
            response_seq=resp,
            played_ms=applied,
            truncate=truncate,
            event_id=event_id,
        )
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

    # ------------------------------------------------------------------ input audio
    def on_input_audio(self, pcm: bytes, vad: Sequence[VadEvent], now_ms: float) -> list[Action]:
        """One processed chunk (engine input rate) and the VAD decisions it produced."""
        if self.closed:
            return []
        self.now_ms = now_ms
        out = self._steps(self.input.on_audio(pcm, vad, self.config.turn_detection), now_ms)
        return out + self._idle_check(now_ms)

    def _idle_check(self, now_ms: float) -> list[Action]:
        """``idle_timeout_ms`` of silence after a response (and its audio): tell the client
        and prompt the user with a response; once per silence."""
        td = self.config.turn_detection
        since = self.idle_since_ms
        if (
            td is None
            or td.idle_timeout_ms is None
            or since is None
            or self.responses.active
            or self.input.speech_item is not None
            or now_ms - since < td.idle_timeout_ms
            or self.config.session_type != "realtime"
        ):
            return []
        self.idle_since_ms = None
        end = int(self.input.input_ms)
        start = max(0, end - int(now_ms - since))
        item_id = self.items.new_id("item")
        note = (
            "The user has said nothing for a while. Ask them briefly whether they are still there."
        )
        instructions = f"{self.config.instructions}\n\n{note}".strip()
        options = ResponseOptions(instructions=instructions, tool_choice="none")
        self.responses.requested(Requested(options))
        self.usage.committed()
        return [
            Send(ev.InputTimeoutTriggered(audio_start_ms=start, audio_end_ms=end, item_id=item_id)),
            Call(Commit(self.epoch, respond=True, response=options)),
        ]

    def _steps(self, steps: Sequence[TurnStep], now_ms: float) -> list[Action]:
        out: list[Action] = []
        for step in steps:
            if isinstance(step, AudioReady):
                self.usage.appended(input_ms(len(step.pcm)))
                out.append(Call(Append(self.epoch, audio=step.pcm, stream_ms=step.stream_ms)))
            elif isinstance(step, SpeechBegan):
                self.idle_since_ms = None  # the user speaks: no idle timeout this silence
                start = int(step.audio_start_ms)
                out.append(Send(ev.SpeechStarted(audio_start_ms=start, item_id=step.item_id)))
            elif isinstance(step, Speaking):
                out += self._maybe_barge_in(now_ms, step.speech_ms)
            elif isinstance(step, SpeechEnded):
                # the moment the last voiced audio arrived: the input clock runs
                # input_ms - audio_end_ms ahead of it
                last = now_ms - max(0.0, self.input.input_ms - step.audio_end_ms)
                self.turn_moments = {"last_voice": last, "speech_stopped": now_ms}
                out += self._maybe_barge_in(now_ms, step.speech_ms)
                end = int(step.audio_end_ms)
                out.append(Send(ev.SpeechStopped(audio_end_ms=end, item_id=step.item_id)))
                respond = self.config.create_response
                out += self._commit_user_audio(step.item_id, respond=respond, event_id=None)
            elif isinstance(step, Paused):
                respond = self.config.create_response
                out.append(Call(Speculate(self.epoch, "input.pause", respond=respond)))
            elif isinstance(step, Resumed):
                out.append(Call(Speculate(self.epoch, "input.resume")))
        return out

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

    # ------------------------------------------------------------------ call results
    def on_result(self, command: EngineCommand, accepted: Fence | None) -> None:
        """An engine call succeeded; adopt the engine's turn and response counters."""
        if accepted is None:
            return
        if isinstance(command, Commit) and command.item_id is not None:
            self.items.commit_accepted(command.item_id, accepted.turn_id)
        if (accepted.turn_id, accepted.response_seq) > (self.turn_id, self.response_seq):
            self.turn_id = max(self.turn_id, accepted.turn_id)
            self.response_seq = max(self.response_seq, accepted.response_seq)
        if accepted.epoch > self.epoch:
            self.epoch = accepted.epoch

    def on_failure(self, command: EngineCommand, exc: BaseException) -> list[Action]:
        """An engine call failed; the engine changed nothing."""
        if isinstance(command, Cancel) and isinstance(exc, ControlError):
            if exc.code == "nothing_to_cancel":
                return []  # the response ended meanwhile; response.done was already sent
        if isinstance(command, Commit):
            if command.respond:
                self.responses.request_failed()
            if command.item_id is not None:
                self.items.commit_failed(command.item_id)
        if isinstance(command, CloseSession):
            return []
        return self.error(exc, command.event_id)


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
