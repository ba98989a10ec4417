"""The per-session protocol state machine (sans-I/O).

:class:`SessionCore` takes parsed client events, processed input audio (with VAD
decisions), engine session events and engine call results, each with the current time in
milliseconds passed in, and returns :mod:`~duplex_server.protocol.commands` actions: server
events to send, engine calls to make, local actions. It never awaits, never touches a
socket and never reads the clock. The adapter (``duplex_server.realtime``) executes actions
in order and makes no protocol decisions of its own. The events of a response are built by
:mod:`~duplex_server.protocol.responses`; VAD decisions arrive as
:mod:`~duplex_server.protocol.vad` events.

Epochs: every cancel the core decides advances ``epoch`` at once (the engine accepts exactly
one epoch step per cancel), so output of an older epoch is dropped here before it becomes an
event, queued audio below the epoch is purged (:class:`PurgeAudio`), and the writer checks
:attr:`SessionCore.epoch` again before each audio frame.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence

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
    EngineCommand,
    ProcessAudio,
    PurgeAudio,
    Send,
    Speculate,
    Touch,
    Update,
)
from duplex_server.protocol.config import EffectiveSession, apply_patch
from duplex_server.protocol.errors import CloseCode, ProtocolError, to_wire_error
from duplex_server.protocol.responses import (
    Response,
    audio_events,
    finished_events,
    started_events,
)
from duplex_server.protocol.vad import VadEvent, VadPause, VadResume, VadStart, VadStop
from engine.errors import ControlError
from engine.messages import (
    AudioChunk,
    Fence,
    ResponseDone,
    ResponseStarted,
    SessionEvent,
    SessionLifecycle,
    TextDelta,
    UserTranscript,
)

log = logging.getLogger(__name__)

_BYTES_PER_MS = 32  # PCM16 mono 16 kHz (engine input)
_MAX_ITEMS = 256


def _identity(pcm: bytes, rate: int, fmt: AudioFormat) -> bytes:
    return pcm


class SessionCore:
    """One session's protocol state; survives socket changes (resume, takeover)."""

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
        self.response_seq = 0
        self.closed = False
        self.encode_output = encode_output
        self._n = 0
        self._response: Response | None = None
        self._response_pending = 0  # commits with respond=True not started yet
        self._speech_item: str | None = None  # user item of the speech in progress
        self._speech_onset_ms: float | None = None
        self._input_ms = 0.0  # session audio clock (processed input)
        self._uncommitted_ms = 0.0  # audio appended to the engine since the last commit
        self._uncommitted_text = False
        self._ring: deque[bytes] = deque()
        self._ring_bytes = 0
        self._pending_items: deque[str] = deque()  # committed audio items, commit unanswered
        self._item_by_turn: OrderedDict[int, str] = OrderedDict()
        self._last_item: str | None = None
        self._items: OrderedDict[str, ev.Item] = OrderedDict()
        self._assistant: OrderedDict[str, tuple[int, int, float]] = OrderedDict()

    # ------------------------------------------------------------------ ids and helpers
    def _id(self, kind: str) -> str:
        self._n += 1
        return f"{kind}_{self.session_id[5:17]}{self._n:05d}"

    @property
    def position(self) -> Fence:
        return Fence(self.session_id, self.epoch, self.turn_id, self.response_seq)

    def fence_for(self, epoch: int) -> Fence:
        """The fence an engine call decided at ``epoch`` carries when it is executed."""
        return Fence(self.session_id, epoch, self.turn_id, self.response_seq)

    def _remember(self, item: ev.Item) -> None:
        self._items[item.id] = item
        while len(self._items) > _MAX_ITEMS:
            self._items.popitem(last=False)

    @property
    def response_active(self) -> bool:
        return self._response is not None or self._response_pending > 0

    @property
    def beta(self) -> bool:
        return self.config.event_names == "beta"

    # ------------------------------------------------------------------ handshake
    def opened(self, resume_token: str, capabilities: ev.Capabilities) -> list[Action]:
        return [
            Send(
                ev.SessionCreated(
                    session=self.config.to_wire(self.session_id),
                    resume_token=resume_token,
                    capabilities=capabilities,
                )
            ),
            ConfigureInput(self.config.input_format, self.config.turn_detection),
        ]

    # ------------------------------------------------------------------ client events
    def on_client_event(self, event: ev.AnyClientEvent, now_ms: float) -> list[Action]:
        if self.closed:
            return []
        try:
            return self._dispatch(event, now_ms)
        except ProtocolError as exc:
            detail, close = to_wire_error(exc, event_id=event.event_id)
            out: list[Action] = [Send(ev.Error(error=detail))]
            if close is not None:
                out.append(CloseSocket(close, detail.code))
            return out

    def on_binary_audio(self, data: bytes) -> list[Action]:
        return [] if self.closed or not data else [ProcessAudio(data)]

    def error(self, exc: BaseException, event_id: str | None = None) -> list[Action]:
        detail, close = to_wire_error(exc, event_id=event_id)
        out: list[Action] = [Send(ev.Error(error=detail))]
        if close is not None:
            out.append(CloseSocket(close, detail.code))
        return out

    def _dispatch(self, e: ev.AnyClientEvent, now_ms: float) -> list[Action]:
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
            if self.response_active:
                raise ProtocolError(
                    "conversation_already_has_active_response",
                    "a response is in progress; cancel it first",
                )
            self._response_pending += 1
            return [Call(Commit(self.epoch, respond=True, event_id=e.event_id))]
        if isinstance(e, ev.ResponseCancel):
            if not self.response_active or (
                e.response_id is not None
                and (self._response is None or self._response.id != e.response_id)
            ):
                raise ProtocolError(
                    "response_cancel_not_active",
                    "no such response in progress",
                    param="response_id",
                )
            return self._cancel("response.cancel", "client_cancelled", e.event_id)
        if isinstance(e, ev.OutputAudioBufferClear):
            if self.response_active:
                return self._cancel("response.cancel", "client_cancelled", e.event_id)
            return [Send(ev.OutputAudioCleared(response_id=None))]
        if isinstance(e, ev.BargeIn):
            return (
                self._cancel("barge_in", "turn_detected", e.event_id)
                if self.response_active
                else []
            )
        if isinstance(e, ev.ConversationItemTruncate):
            return self._truncate(e.item_id, float(e.audio_end_ms), e.event_id, truncate=True)
        if isinstance(e, ev.PlaybackAck):
            return self._truncate(e.item_id, e.played_ms, e.event_id, truncate=False)
        if isinstance(e, ev.ConversationItemRetrieve):
            item = self._items.get(e.item_id)
            if item is None:
                raise ProtocolError("item_not_found", f"no item {e.item_id}", param="item_id")
            return [Send(ev.ItemRetrieved(item=item))]
        if isinstance(e, ev.ConversationItemDelete):
            raise ProtocolError(
                "unsupported", "items cannot be deleted from the engine's history", param="item_id"
            )
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
            Send(ev.SessionClosed(reason=reason)),
            CloseSocket(CloseCode.NORMAL, reason),
        ]

    def _update(self, e: ev.SessionUpdate) -> list[Action]:
        old = self.config
        new = apply_patch(old, e.session)
        self.config = new
        out: list[Action] = []
        if (
            new.instructions != old.instructions
            or new.voice != old.voice
            or new.output_modalities != old.output_modalities
            or new.max_output_tokens != old.max_output_tokens
            or new.temperature != old.temperature
        ):
            out.append(
                Call(
                    Update(
                        self.epoch,
                        instructions=new.instructions,
                        voice=new.voice,
                        output_modalities=new.output_modalities,
                        max_output_tokens=new.max_output_tokens,
                        temperature=new.temperature,
                        event_id=e.event_id,
                    )
                )
            )
        if new.input_format != old.input_format or new.turn_detection != old.turn_detection:
            self._ring.clear()
            self._ring_bytes = 0
            self._speech_item = None
            self._speech_onset_ms = None
            out.append(ConfigureInput(new.input_format, new.turn_detection))
        out.append(Send(ev.SessionUpdated(session=new.to_wire(self.session_id))))
        return out

    def _commit_input(self, event_id: str | None) -> list[Action]:
        if self._uncommitted_ms <= 0 and not self._ring_bytes:
            raise ProtocolError(
                "input_audio_buffer_commit_empty", "the input audio buffer is empty"
            )
        out = self._flush_ring()
        item_id = self._speech_item or self._id("item")
        self._speech_item = None
        self._speech_onset_ms = None
        out += self._commit_user_audio(item_id, respond=False, event_id=event_id)
        return out

    def _commit_user_audio(
        self, item_id: str, *, respond: bool, event_id: str | None
    ) -> list[Action]:
        self._uncommitted_ms = 0.0
        self._uncommitted_text = False
        if respond:
            self._response_pending += 1
        previous = self._last_item
        self._last_item = item_id
        self._pending_items.append(item_id)
        item = ev.Item(
            id=item_id,
            role="user",
            content=[ev.ContentPart(type="input_audio", transcript=None)],
            status="in_progress",
        )
        self._remember(item)
        return [
            Call(Commit(self.epoch, respond=respond, event_id=event_id, item_id=item_id)),
            Send(ev.InputCommitted(item_id=item_id, previous_item_id=previous)),
            Send(ev.ItemAdded(item=item, previous_item_id=previous)),
        ]

    def _clear_input(self, event_id: str | None) -> list[Action]:
        out: list[Action] = []
        self._ring.clear()
        self._ring_bytes = 0
        self._speech_item = None
        self._speech_onset_ms = None
        if self._uncommitted_ms > 0 or self._uncommitted_text:
            # The engine's input.cancel also drops the work of the current epoch.
            out += self._cancel("input.cancel", "input_cancelled", event_id)
            self._uncommitted_ms = 0.0
            self._uncommitted_text = False
        out.append(Send(ev.InputCleared()))
        return out

    def _create_item(self, e: ev.ConversationItemCreate) -> list[Action]:
        item = e.item
        if item.role != "user":
            raise ProtocolError("unsupported", "only user items can be created", param="item.role")
        texts: list[str] = []
        for i, part in enumerate(item.content):
            if part.type not in ("input_text", "text") or not isinstance(part.text, str):
                raise ProtocolError(
                    "unsupported",
                    "user items carry input_text content (send audio with input_audio_buffer)",
                    param=f"item.content.{i}.type",
                )
            texts.append(part.text)
        text = " ".join(t for t in texts if t.strip())
        if not text:
            raise ProtocolError("invalid_value", "the item has no text", param="item.content")
        item_id = item.id if isinstance(item.id, str) else self._id("item")
        previous = self._last_item
        self._last_item = item_id
        self._uncommitted_text = True
        wire = ev.Item(
            id=item_id, role="user", content=[ev.ContentPart(type="input_text", text=text)]
        )
        self._remember(wire)
        return [
            Call(Append(self.epoch, text=text, event_id=e.event_id)),
            Send(ev.ItemAdded(item=wire, previous_item_id=previous)),
            Send(ev.ItemDone(item=wire, previous_item_id=previous)),
        ]

    def _truncate(
        self, item_id: str, played_ms: float, event_id: str | None, *, truncate: bool
    ) -> list[Action]:
        rec = self._assistant.get(item_id)
        if rec is None:
            raise ProtocolError(
                "item_not_found", f"no assistant audio item {item_id}", param="item_id"
            )
        turn, resp, sent_ms = rec
        active = self._response is not None and self._response.item_id == item_id
        if active:
            assert self._response is not None
            sent_ms = self._response.audio_ms
        applied = min(played_ms, sent_ms)
        out: list[Action] = [
            Call(
                Touch(
                    self.epoch,
                    "playback_ack",
                    turn_id=turn,
                    response_seq=resp,
                    played_ms=applied,
                    truncate=truncate,
                    event_id=event_id,
                )
            )
        ]
        if truncate:
            out.append(
                Send(
                    ev.ItemTruncated(
                        item_id=item_id,
                        content_index=0,
                        audio_end_ms=int(applied),
                        requested_audio_end_ms=int(played_ms),
                    )
                )
            )
        else:
            out.append(
                Send(
                    ev.PlaybackAcknowledged(
                        item_id=item_id, played_ms=applied, requested_played_ms=played_ms
                    )
                )
            )
        return out

    # ------------------------------------------------------------------ cancel / barge-in
    def _cancel(self, kind: str, reason: str, event_id: str | None) -> list[Action]:
        out: list[Action] = []
        old = self.epoch
        self.epoch += 1
        self._response_pending = 0
        resp = self._response
        if resp is not None:
            out += self._finish(resp, "cancelled", reason, None)
            out.append(Send(ev.OutputAudioCleared(response_id=resp.id)))
        out.append(PurgeAudio(self.epoch))
        out.append(Call(Cancel(old, kind, event_id=event_id)))  # type: ignore[arg-type]
        return out

    # ------------------------------------------------------------------ input audio
    def on_input_audio(self, pcm16k: bytes, vad: Sequence[VadEvent], now_ms: float) -> list[Action]:
        """One processed chunk (PCM16 16 kHz) and the VAD decisions it produced."""
        if self.closed:
            return []
        out: list[Action] = []
        chunk_ms = len(pcm16k) / _BYTES_PER_MS
        td = self.config.turn_detection
        if td is None:
            self._input_ms += chunk_ms
            if pcm16k:
                self._uncommitted_ms += chunk_ms
                out.append(Call(Append(self.epoch, audio=pcm16k)))
            return out
        # server VAD: idle audio waits in a ring (prefix padding); speech goes to the engine
        self._ring.append(pcm16k)
        self._ring_bytes += len(pcm16k)
        self._input_ms += chunk_ms
        for v in vad:
            if isinstance(v, VadStart) and self._speech_item is None:
                self._speech_item = self._id("item")
                self._speech_onset_ms = v.onset_ms
                start = max(0.0, v.audio_start_ms)
                self._trim_ring(keep_ms=self._input_ms - start)
                out.append(
                    Send(ev.SpeechStarted(audio_start_ms=int(start), item_id=self._speech_item))
                )
            elif isinstance(v, VadStop) and self._speech_item is not None:
                out += self._flush_ring()
                # A whole utterance can arrive in one processed batch (a backlog): it still
                # interrupts, judged by its own length, before its turn is committed.
                assert self._speech_onset_ms is not None
                out += self._maybe_barge_in(now_ms, v.audio_end_ms - self._speech_onset_ms)
                item_id = self._speech_item
                self._speech_item = None
                self._speech_onset_ms = None
                out.append(
                    Send(ev.SpeechStopped(audio_end_ms=int(v.audio_end_ms), item_id=item_id))
                )
                out += self._commit_user_audio(item_id, respond=td.create_response, event_id=None)
            elif isinstance(v, VadPause) and self._speech_item is not None:
                out += self._flush_ring()  # all speech so far reaches the engine first
                out.append(Call(Speculate(self.epoch, "input.pause")))
            elif isinstance(v, VadResume) and self._speech_item is not None:
                out.append(Call(Speculate(self.epoch, "input.resume")))
        if self._speech_item is not None:
            out += self._flush_ring()
            assert self._speech_onset_ms is not None
            out += self._maybe_barge_in(now_ms, self._input_ms - self._speech_onset_ms)
        else:
            keep = td.prefix_padding_ms + 1000
            self._trim_ring(keep_ms=keep)
        return out

    def _trim_ring(self, keep_ms: float) -> None:
        keep = int(keep_ms * _BYTES_PER_MS)
        while self._ring and self._ring_bytes - len(self._ring[0]) >= keep:
            self._ring_bytes -= len(self._ring.popleft())
        if self._ring and self._ring_bytes > keep:
            cut = (self._ring_bytes - keep) & ~1
            self._ring[0] = self._ring[0][cut:]
            self._ring_bytes -= cut

    def _flush_ring(self) -> list[Action]:
        if not self._ring_bytes:
            return []
        data = b"".join(self._ring)
        self._ring.clear()
        self._ring_bytes = 0
        self._uncommitted_ms += len(data) / _BYTES_PER_MS
        return [Call(Append(self.epoch, audio=data))]

    def _maybe_barge_in(self, now_ms: float, speech_ms: float) -> list[Action]:
        """Interrupt the response if ``speech_ms`` of user speech passes the guards."""
        td = self.config.turn_detection
        # A pending response (its user turn still being transcribed) is interrupted too: the
        # engine keeps that turn's words in the conversation (transcribed, not answered), so a
        # pause inside a sentence ends in one answer to the whole sentence, not two.
        if td is None or not td.interrupt_response or not self.response_active:
            return []
        if speech_ms < td.min_interrupt_speech_ms:
            return []
        if (
            self._response is not None
            and now_ms - self._response.started_ms < td.uninterruptible_ms
        ):
            return []
        return self._cancel("barge_in", "turn_detected", None)

    # ------------------------------------------------------------------ engine events
    def on_engine_event(self, event: SessionEvent, now_ms: float) -> list[Action]:
        if isinstance(event, SessionLifecycle):
            return self._lifecycle(event)
        if self.closed or event.fence.epoch < self.epoch:
            return []  # stale: a cancelled epoch's output never becomes an event
        if isinstance(event, AudioChunk):
            return self._audio(event)
        if isinstance(event, UserTranscript):
            return self._user_transcript(event)
        if isinstance(event, ResponseStarted):
            return self._start(event.fence, now_ms)
        if isinstance(event, TextDelta):
            resp = self._response
            if resp is None or resp.audio:
                return []
            resp.parts.append(event.text)
            return [Send(ev.TextDelta(response_id=resp.id, item_id=resp.item_id, delta=event.text))]
        assert isinstance(event, ResponseDone)
        resp = self._response
        if resp is None or resp.fence != event.fence:
            return []
        error = None
        if event.error is not None:
            error = ev.ErrorDetail(
                type="server_error", code=event.error.code, message=event.error.message
            )
        return self._finish(resp, event.status, event.reason, error, tokens=event.output_tokens)

    def _lifecycle(self, event: SessionLifecycle) -> list[Action]:
        if event.state == "expiring":
            return [Send(ev.SessionExpiring(in_s=event.in_s or 0.0, reason=event.reason))]
        if self.closed and event.state == "closed":
            return []
        self.closed = True
        out: list[Action] = []
        if event.state == "expired":
            out.append(Send(ev.SessionExpired(reason=event.reason)))
        out.append(Send(ev.SessionClosed(reason=event.reason or event.state)))
        out.append(CloseSocket(CloseCode.NORMAL, event.reason or event.state))
        return out

    def _user_transcript(self, event: UserTranscript) -> list[Action]:
        item_id = self._item_by_turn.get(event.fence.turn_id)
        if item_id is None and self._pending_items:
            # the transcript overtook its commit's reply: jobs run in commit order, so it
            # belongs to the oldest commit still unanswered
            item_id = self._pending_items.popleft()
            self._item_by_turn[event.fence.turn_id] = item_id
        if item_id is None:
            return []
        if not event.final:
            return [Send(ev.InputTranscriptDelta(item_id=item_id, delta=event.text))]
        del self._item_by_turn[event.fence.turn_id]
        item = ev.Item(
            id=item_id,
            role="user",
            content=[ev.ContentPart(type="input_audio", transcript=event.text)],
        )
        self._remember(item)
        return [
            Send(ev.InputTranscriptDelta(item_id=item_id, delta=event.text)),
            Send(ev.InputTranscriptCompleted(item_id=item_id, transcript=event.text)),
            Send(ev.ItemDone(item=item)),
        ]

    def _start(self, fence: Fence, now_ms: float) -> list[Action]:
        out: list[Action] = []
        if self._response is not None:  # should not happen: close the old one first
            out += self._finish(self._response, "incomplete", "superseded", None)
        self._response_pending = max(0, self._response_pending - 1)
        audio = "audio" in self.config.output_modalities
        resp = Response(
            id=self._id("resp"),
            item_id=self._id("item"),
            fence=fence,
            started_ms=now_ms,
            audio=audio,
        )
        self._response = resp
        if audio:
            self._assistant[resp.item_id] = (fence.turn_id, fence.response_seq, 0.0)
            while len(self._assistant) > _MAX_ITEMS:
                self._assistant.popitem(last=False)
        previous = self._last_item
        self._last_item = resp.item_id
        out += started_events(resp, list(self.config.output_modalities), previous)
        return out

    def _audio(self, chunk: AudioChunk) -> list[Action]:
        resp = self._response
        if resp is None or resp.fence != chunk.fence or not resp.audio:
            return []
        data = self.encode_output(chunk.pcm, chunk.sample_rate, self.config.output_format)
        return audio_events(resp, chunk, data)

    def _finish(
        self,
        resp: Response,
        status: str,
        reason: str | None,
        error: ev.ErrorDetail | None,
        *,
        tokens: int = 0,
    ) -> list[Action]:
        self._response = None
        if resp.audio:
            self._assistant[resp.item_id] = (
                resp.fence.turn_id,
                resp.fence.response_seq,
                resp.audio_ms,
            )
        item, out = finished_events(
            resp, status, reason, error, tokens, list(self.config.output_modalities)
        )
        self._remember(item)
        return out

    # ------------------------------------------------------------------ call results
    def on_result(self, command: EngineCommand, accepted: Fence | None) -> None:
        """An engine call succeeded; adopt the engine's turn and response counters."""
        if accepted is None:
            return
        if isinstance(command, Commit) and command.item_id is not None:
            if self._pending_items and self._pending_items[0] == command.item_id:
                self._pending_items.popleft()
            self._item_by_turn[accepted.turn_id] = command.item_id
            while len(self._item_by_turn) > _MAX_ITEMS:
                self._item_by_turn.popitem(last=False)
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
                self._response_pending = max(0, self._response_pending - 1)
            if command.item_id is not None and command.item_id in self._pending_items:
                self._pending_items.remove(command.item_id)
        if isinstance(command, CloseSession):
            return []
        return self.error(exc, command.event_id)
