"""The GPT-Live adapter (sans-I/O): the Live wire on the same session core as the Realtime
route.

:class:`LiveAdapter` sits between a Live transport and the session core
(:class:`~duplex_server.protocol.machine.SessionMachine`), which it drives only through the
core's own public inputs: Live client events become the Realtime client events they stand
for (an audio append, a function call's output, a ``response.create`` with instructions, a
``session.update``); nothing in the core knows the wire. On the way out
(:meth:`LiveAdapter.translate`, applied by the session runtime to every batch of the core's
actions) the core's Realtime events become Live events or are dropped:

* ``session.created`` -> ``session.started`` (with a resume token); errors -> Live errors;
* a user turn's final transcript -> ``session.input_transcript.delta`` timed by the turn's
  speech on the input clock (``input_audio_buffer.speech_started`` / ``.stopped``);
* reply audio stays audio for the transport's pacer, and each transcript mark becomes an
  internal :class:`~duplex_server.protocol.live_events.LiveMark` the transport releases
  with the audio (:mod:`~duplex_server.protocol.live_output`);
* ``output_audio_buffer.cleared`` / ``.paused`` (barge-in: a stop, a pause) and
  ``response.output_audio.done`` go to the transport's pacer (and :mod:`.live_pause`);
* a finished response that called ``delegate`` -> ``session.delegation.created`` (and, in
  responses mode, the backend's first model call: :class:`RunBackend`);
* ``session.closed`` -> a last ``session.usage.updated`` and Live's ``session.closed``;
* everything else of the Realtime lifecycle is dropped: the model owns the turn, and the
  wire has no turn, item or response events.

The turn is the core's: server VAD ends it and asks for a response; a VAD onset over the
answer is the core's one barge-in decision. The adapter adds no rule of its own.
"""

from __future__ import annotations

import base64
from collections import OrderedDict
from typing import Any

import msgspec

from duplex_contract.batch import BatchItem
from duplex_server.protocol import events as ev
from duplex_server.protocol.codec import decode_audio_b64
from duplex_server.protocol.commands import Action, Send, SendAudio, SendStamped
from duplex_server.protocol.errors import ProtocolError
from duplex_server.protocol.live_config import (
    DELEGATE_TOOL,
    Backend,
    LiveOptions,
    LiveStart,
    parse_backend,
)
from duplex_server.protocol.live_delegation import (
    SAY_NOTE,
    Delegations,
    Line,
    LiveAction,
    Step,
    StopBackends,
    respond,
)
from duplex_server.protocol.live_events import (
    UNSUPPORTED_EVENTS,
    AnyLiveClientEvent,
    LiveAudioAppend,
    LiveAudioOut,
    LiveAudioOutputOut,
    LiveCommentaryAppend,
    LiveCommentaryAppended,
    LiveContextWindow,
    LiveError,
    LiveErrorObj,
    LiveFormatOut,
    LiveInfo,
    LiveInputTranscript,
    LiveInstructionsAppend,
    LiveInstructionsAppended,
    LiveMark,
    LiveMute,
    LiveMuted,
    LiveResponseCreate,
    LiveResponseItemCreate,
    LiveServerEvent,
    LiveSessionClose,
    LiveSessionClosed,
    LiveSessionResource,
    LiveSessionStart,
    LiveSessionStarted,
    LiveSessionUpdate,
    LiveSessionUpdated,
    LiveThinkingAppend,
    LiveThinkingAppended,
    LiveUnmute,
    LiveUnmuted,
    LiveUsage,
    LiveUsageUpdated,
    ResponsesDelegation,
    decode_live_event,
    is_live_frame,
)
from duplex_server.protocol.live_pause import TRANSPORT_EVENTS, PausedEnds
from duplex_server.protocol.machine import SessionMachine

#: the longest text one append may carry (OpenAI's limit is 500 tokens an append)
MAX_APPEND_CHARS = 8000
#: user turns whose speech bounds are kept for their transcripts
_KEEP_TURNS = 32
#: the core's close reasons -> Live's ``session.closed`` reasons
CLOSE_REASONS = {
    "client": "close_requested",
    "client_closed_socket": "close_requested",
    "expired": "expired",
    "max_duration": "expired",
    "idle_timeout": "expired",
}
_SILENCE_BYTE = {"pcm16": 0, "g711_ulaw": 0xFF, "g711_alaw": 0xD5}


class LiveReplica(msgspec.Struct, frozen=True, array_like=True):
    """A Live session's wire state in its replica (:meth:`LiveAdapter.state`)."""

    start: LiveStart
    started_unix: float
    expires_at: int
    ack_delay_ms: int
    backend: Backend | None
    delegation_wire: dict[str, Any] | None


_REPLICA_ENCODER = msgspec.msgpack.Encoder()
_REPLICA_DECODER = msgspec.msgpack.Decoder(LiveReplica)


class LiveAdapter:
    """One Live session's wire state around its core. ``now_ms``: the runtime's monotonic
    clock; ``unix_s``: the wall clock at start (``expires_at``)."""

    def __init__(
        self,
        core: SessionMachine,
        start: LiveStart,
        options: LiveOptions,
        *,
        now_ms: float,
        unix_s: float,
    ) -> None:
        self.core = core
        self.start = start
        self.options = options
        self.started_ms = now_ms
        self.started_unix = unix_s
        self.expires_at = int(unix_s + options.max_session_s)
        self.muted = False
        self.attached = True
        self.delegations = Delegations(core, start, options)
        #: the newest event seq a transport wrote (a reconnect without ``last_event_id``
        #: is sent what came after it)
        self.written_seq = 0
        self.delegation_wire = start.delegation_wire
        self._speech: OrderedDict[str, list[float]] = OrderedDict()
        self._audio_at: dict[str, float] = {}
        self._usage_due = now_ms + options.usage_interval_s * 1000
        self._prompt_tokens = 0
        self._ended = False
        self._ends = PausedEnds(core.playout)  # a paused answer's end waits for its audio

    # ------------------------------------------------------------------ failover
    def state(self) -> bytes:
        """What a front end taking the session over needs of the wire (the replica's
        ``wire``): the start, the clock, the delegation settings. Delegations in flight
        are not kept: a crash loses them (docs/protocol.md, "GPT-Live")."""
        work = self.delegations
        rep = LiveReplica(
            self.start,
            self.started_unix,
            self.expires_at,
            work.ack_delay_ms,
            work.backend,
            self.delegation_wire,
        )
        return _REPLICA_ENCODER.encode(rep)

    @classmethod
    def restore(
        cls,
        core: SessionMachine,
        blob: bytes,
        options: LiveOptions,
        *,
        now_ms: float,
        unix_s: float,
    ) -> LiveAdapter:
        """The adapter of a session taken over (``blob``: :meth:`state`); raises
        ``msgspec.DecodeError`` / ``ValidationError`` on junk."""
        rep = _REPLICA_DECODER.decode(blob)
        adapter = cls(core, rep.start, options, now_ms=now_ms, unix_s=rep.started_unix)
        adapter.started_ms = now_ms - max(0.0, unix_s - rep.started_unix) * 1000
        adapter.expires_at = rep.expires_at
        adapter.delegations.ack_delay_ms = rep.ack_delay_ms
        adapter.delegations.backend = rep.backend
        adapter.delegation_wire = rep.delegation_wire
        return adapter

    @property
    def session_ms(self) -> int:
        """Now on the session timeline: the input audio received (ms)."""
        return int(self.core.input.input_ms)

    # ------------------------------------------------------------------ the session resource
    def resource(self) -> LiveSessionResource:
        s = self.start
        fmt = None
        if s.format is not None:
            fmt = LiveFormatOut(type=s.format.to_wire().type, rate=s.format.rate)
        return LiveSessionResource(
            id=self.core.session_id,
            expires_at=self.expires_at,
            model=s.model,
            instructions=s.instructions,
            audio=LiveAudioOut(format=fmt, output=LiveAudioOutputOut(voice=s.voice)),
            delegation=self.delegation_wire,
            input=s.input_wire,
        )

    def usage(self, now_ms: float) -> LiveUsageUpdated:
        ratio = min(1.0, self._prompt_tokens / max(1, self.options.context_window_tokens))
        return LiveUsageUpdated(
            usage=LiveUsage(seconds=round(max(0.0, now_ms - self.started_ms) / 1000, 3)),
            context_window=LiveContextWindow(usage_ratio=round(ratio, 4)),
        )

    # ------------------------------------------------------------------ out: the core's actions
    def translate(
        self, actions: list[Action], now_ms: float
    ) -> tuple[list[Action], list[LiveAction]]:
        """The core's actions as the Live wire has them (and the runtime's own work)."""
        out: list[Action] = []
        live: list[LiveAction] = []
        for action in actions:
            if isinstance(action, Send):
                if not self._ends.hold(action):
                    self._send(action.event, now_ms, out, live)
                    self._ends.sent(action, out)
            elif isinstance(action, SendAudio):
                self._audio_at[action.item_id] = action.audio_start_ms
                out.append(action)
                self._ends.audio(action)
            elif isinstance(action, SendStamped):  # a replay: Live events, never audio
                frames = tuple(f for f in action.frames if is_live_frame(f))
                if frames:
                    out.append(SendStamped(frames))
            else:
                out.append(action)
        self._ends.batch_done(out)
        return out, live

    def _send(
        self, event: ev.ServerEvent, now_ms: float, out: list[Action], live: list[LiveAction]
    ) -> None:
        sid = self.core.session_id
        if isinstance(event, LiveServerEvent | TRANSPORT_EVENTS):
            out.append(Send(event))
        elif isinstance(event, ev.SessionCreated):
            token = f"{sid}.{event.resume_token}"
            out.append(Send(LiveSessionStarted(session=self.resource(), resume_token=token)))
        elif isinstance(event, ev.Error):
            d = event.error
            obj = LiveErrorObj(d.type, d.code, d.message, d.param, d.event_id)
            out.append(Send(LiveError(error=obj, client_event_id=d.event_id)))
        elif isinstance(event, ev.SpeechStarted):
            self._speech[event.item_id] = [float(event.audio_start_ms), float(event.audio_start_ms)]
            while len(self._speech) > _KEEP_TURNS:
                self._speech.popitem(last=False)
        elif isinstance(event, ev.SpeechStopped):
            bounds = self._speech.setdefault(event.item_id, [0.0, 0.0])
            bounds[1] = float(event.audio_end_ms)
        elif isinstance(event, ev.InputTranscriptCompleted):
            start, end = self._speech.pop(event.item_id, [self.session_ms, self.session_ms])
            if event.transcript.strip():
                delta = LiveInputTranscript(
                    delta=event.transcript, start_ms=int(start), end_ms=int(max(start, end))
                )
                out.append(Send(delta))
        elif isinstance(event, ev.TranscriptDelta):
            if event.delta:
                at = self._audio_at.get(event.item_id, 0.0)
                out.append(Send(LiveMark(item_id=event.item_id, start_ms=at, text=event.delta)))
        elif isinstance(event, ev.ResponseDone):
            self._response_done(event.response, now_ms, out, live)
        elif isinstance(event, ev.SessionClosed):
            self._ended = True
            self.delegations.floor.clear()
            live.append(StopBackends())
            reason = CLOSE_REASONS.get(event.reason, "connection_lost")
            out.append(Send(self.usage(now_ms)))
            closed = LiveSessionClosed(
                reason=reason,  # type: ignore[arg-type]
                session=self.resource(),
                usage=self.usage(now_ms).usage,
            )
            out.append(Send(closed))
        elif isinstance(event, ev.SessionResumed):
            token = f"{sid}.{event.resume_token}"
            note = "the session was resumed; use this resume_token for the next reconnect"
            out.append(Send(LiveInfo(code="session.resumed", message=note, resume_token=token)))
        elif isinstance(event, ev.ResyncRequired):
            out.append(Send(LiveInfo(code="session.resync_required", message=event.reason)))

    def _response_done(
        self, resp: ev.ResponseObj, now_ms: float, out: list[Action], live: list[LiveAction]
    ) -> None:
        usage = resp.usage
        if usage is not None and usage.input_token_details.text_tokens:
            self._prompt_tokens = usage.input_token_details.text_tokens
        self._audio_at.pop(resp.output[0].id if resp.output else "", None)
        if resp.status != "completed" or self.start.target is None:
            return
        for item in resp.output:
            if isinstance(item, ev.FunctionCallItem) and item.name == DELEGATE_TOOL.name:
                more, work = self.delegations.created(item, self.session_ms, now_ms)
                out += more
                live += work

    # ------------------------------------------------------------------ in: client events
    def on_text(self, text: str | bytes, now_ms: float) -> list[Step]:
        """One client frame."""
        try:
            event = decode_live_event(text)
        except ProtocolError as exc:
            return list(self.core.error(exc))
        return self.on_event(event, now_ms)

    def on_event(self, e: AnyLiveClientEvent, now_ms: float) -> list[Step]:
        if self.core.closed:
            return []
        try:
            return self._dispatch(e, now_ms)
        except ProtocolError as exc:
            return list(self.core.error(exc, e.event_id))

    def _dispatch(self, e: AnyLiveClientEvent, now_ms: float) -> list[Step]:
        core = self.core
        if isinstance(e, LiveAudioAppend):
            audio = self._silence(e.audio) if self.muted else e.audio
            return list(core.on_client_event(ev.InputAudioBufferAppend(audio=audio), now_ms))
        if isinstance(e, LiveMute | LiveUnmute):
            self.muted = isinstance(e, LiveMute)
            done = LiveMuted if self.muted else LiveUnmuted
            return [Send(done(client_event_id=e.event_id))]
        if isinstance(e, LiveInstructionsAppend | LiveThinkingAppend | LiveCommentaryAppend):
            return self._append(e, now_ms)
        if isinstance(e, LiveResponseItemCreate | LiveResponseCreate):
            return self.delegations.backend_event(e)
        if isinstance(e, LiveSessionUpdate):
            return self._update(e)
        if isinstance(e, LiveSessionClose):
            return [StopBackends(), *core.close("client")]
        if isinstance(e, LiveSessionStart):
            raise ProtocolError(
                "invalid_state", "the session has started: session.start is sent once", param="type"
            )
        assert isinstance(e, UNSUPPORTED_EVENTS)
        raise ProtocolError(
            "unsupported", f"{type(e).__struct_config__.tag} is not supported", param="type"
        )

    def _silence(self, audio: str) -> str:
        data = decode_audio_b64(audio)
        fill = _SILENCE_BYTE[self.core.config.input_format.codec]
        return base64.b64encode(bytes([fill]) * len(data)).decode("ascii")

    def _append(
        self,
        e: LiveInstructionsAppend | LiveThinkingAppend | LiveCommentaryAppend,
        now_ms: float,
    ) -> list[Step]:
        if len(e.content) > MAX_APPEND_CHARS:
            raise ProtocolError(
                "invalid_value", f"content is over {MAX_APPEND_CHARS} characters", param="content"
            )
        work = self.delegations
        d = work.for_append(e.delegation_id)
        at = self.session_ms
        out: list[Step] = []
        if isinstance(e, LiveInstructionsAppend):
            out += self._instructions(e.content, now_ms)
            return [
                *out,
                Send(LiveInstructionsAppended(start_ms=at, end_ms=at, client_event_id=e.event_id)),
            ]
        work.floor.cancel_acks()
        if isinstance(e, LiveThinkingAppend):
            if d is not None:
                out += work.result_item(d, e.content, now_ms)
            else:
                out += self._instructions(f"Context: {e.content}", now_ms)
            return [
                *out,
                Send(LiveThinkingAppended(start_ms=at, end_ms=at, client_event_id=e.event_id)),
            ]
        if d is not None:
            out += work.result_item(d, e.content, now_ms)
            work.floor.add(Line(now_ms, (ev.ResponseCreate(),), delegation_id=d.id))
        else:
            say = respond(f"{self.core.config.instructions}\n\n{SAY_NOTE}{e.content}")
            work.floor.add(Line(now_ms, (say,)))
        out.append(Send(LiveCommentaryAppended(start_ms=at, end_ms=at, client_event_id=e.event_id)))
        return [*out, *self.pump(now_ms)]

    def _instructions(self, extra: str, now_ms: float) -> list[Step]:
        new = f"{self.core.config.instructions}\n\n{extra}"
        update = ev.SessionUpdate(session=ev.SessionParam(instructions=new))
        return list(self.core.on_client_event(update, now_ms))

    # ------------------------------------------------------------------ responses mode
    def on_backend(self, delegation_id: str, item: BatchItem, now_ms: float) -> list[Step]:
        """One item of a backend model call's stream."""
        if self._ended:
            return []
        return [*self.delegations.on_backend(delegation_id, item, now_ms), *self.pump(now_ms)]

    def backend_failed(
        self, delegation_id: str, code: str, message: str, now_ms: float
    ) -> list[Step]:
        """A backend model call failed (the engine refused it, or it broke off)."""
        if self._ended:
            return []
        out = self.delegations.backend_failed(delegation_id, code, message, now_ms)
        return [*out, *self.pump(now_ms)]

    # ------------------------------------------------------------------ session.update
    def _update(self, e: LiveSessionUpdate) -> list[Step]:
        patch = e.session
        if patch.triggers:
            raise ProtocolError(
                "unsupported", "decision triggers are not supported", param="session.triggers"
            )
        d = patch.delegation
        if d is not None and not isinstance(d, msgspec.UnsetType):
            kind = d.__struct_config__.tag
            if self.start.target is None or kind != self.start.target:
                raise ProtocolError(
                    "invalid_value",
                    "the delegation type cannot change",
                    param="session.delegation.type",
                )
            work = self.delegations
            if isinstance(d.acknowledgement_delay_ms, int):
                work.ack_delay_ms = max(0, d.acknowledgement_delay_ms)
            if isinstance(d, ResponsesDelegation) and not isinstance(
                d.responses, msgspec.UnsetType
            ):
                work.backend = parse_backend(d.responses, self.options, work.backend)
            wire = dict(self.delegation_wire or {})
            wire.update(msgspec.to_builtins(d))
            self.delegation_wire = wire
        return [Send(LiveSessionUpdated(session=self.resource(), client_event_id=e.event_id))]

    # ------------------------------------------------------------------ time, the floor
    def free(self) -> bool:
        """May the model speak now: a client attached, no response in progress, the user
        not speaking, the last answer's audio all sent?"""
        core = self.core
        return (
            self.attached
            and not self._ended
            and not core.closed
            and not core.responses.active
            and core.input.turns.speech_item is None
            and core.playout.playing() is None
        )

    def pump(self, now_ms: float) -> list[Step]:
        """Say the next line waiting for the floor, if the floor is free."""
        if not self.free():
            return []
        line = self.delegations.floor.next(now_ms)
        if line is None:
            return []
        out: list[Step] = []
        for event in line.events:
            out += self.core.on_client_event(event, now_ms)
        return out

    def tick(self, now_ms: float, unix_s: float) -> list[Step]:
        """Time passes: usage every ``usage_interval_s``, the session's expiry, the floor."""
        if self._ended or self.core.closed:
            return []
        if unix_s >= self.expires_at:
            return [StopBackends(), *self.core.close("expired")]
        out: list[Step] = []
        if now_ms >= self._usage_due:
            self._usage_due = now_ms + self.options.usage_interval_s * 1000
            out.append(Send(self.usage(now_ms)))
        return [*out, *self.pump(now_ms)]

    def dropped(self, now_ms: float) -> list[Step]:
        """The transport went away without closing: the answer in progress stops where its
        audio stopped (as a barge-in would), and nothing is said until a client is back."""
        self.attached = False
        if self.core.closed or not self.core.responses.active:
            return []
        return list(self.core.responses.cancel("barge_in", "client_disconnected", None, now_ms))
