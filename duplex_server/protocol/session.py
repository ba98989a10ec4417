"""The per-session protocol state machine (sans-I/O).

:class:`SessionCore` takes parsed client events, processed input audio (with VAD
decisions), engine session events and engine call results, each with the current time in
milliseconds passed in, and returns :mod:`~duplex_server.protocol.commands` actions: server
events to send, engine calls to make, local actions. It never awaits, never touches a
socket and never reads the clock. The session runtime (``duplex_server.session.live``)
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

from duplex_contract.errors import ControlError
from duplex_contract.fence import Fence
from duplex_server.protocol import events as ev
from duplex_server.protocol.codec import decode_audio_b64
from duplex_server.protocol.commands import (
    AckJournal,
    Action,
    Call,
    Cancel,
    CloseSession,
    Commit,
    EngineCommand,
    ProcessAudio,
    Replicate,
    Send,
    Touch,
)
from duplex_server.protocol.core_admission import Admission
from duplex_server.protocol.core_input import CoreInput
from duplex_server.protocol.errors import ProtocolError
from duplex_server.protocol.responses import (
    Requested,
)


class SessionCore(Admission, CoreInput):
    """One session's protocol state; survives socket changes (resume, takeover).

    Three parts, each testable alone: :attr:`items` (the conversation),
    :attr:`responses` (the response lifecycle) and :attr:`input` (input turns: VAD and
    the prefix ring). The core owns what joins them: the epoch, the engine's turn and
    response counters, and the dispatch of client and engine events.

    Its jobs live in their own modules: the shared state (:mod:`.core_state`), admission
    and resume (:mod:`.core_admission`), input turns (:mod:`.core_input`) and responses
    (:mod:`.core_responses`); this class dispatches client events and call results.
    """

    # ------------------------------------------------------------------ client events
    def on_client_event(self, event: ev.AnyClientEvent, now_ms: float) -> list[Action]:
        if self.closed:
            return []
        try:
            return self._dispatch(event, now_ms)
        except ProtocolError as exc:
            return self.error(exc, event.event_id)

    def _dispatch(self, e: ev.AnyClientEvent, now_ms: float) -> list[Action]:
        self.now_ms = now_ms
        if isinstance(e, ev.InputAudioBufferAppend):
            data = decode_audio_b64(e.audio)
            seq = self.seqs.accept(e.input_seq)
            if seq is None or not data:
                return []  # a re-send of input the session has (input_seq), or empty
            self.seqs.audio(seq, self.config.input_format.duration_ms(len(data)))
            return [ProcessAudio(data)]
        if isinstance(e, ev.SessionUpdate):
            return self._update(e)
        if isinstance(e, ev.InputAudioBufferCommit):
            return self._commit_input(e.event_id)
        if isinstance(e, ev.InputAudioBufferClear):
            return self._clear_input(e.event_id)
        if isinstance(e, ev.ConversationItemCreate):
            seq = self.seqs.accept(e.input_seq)
            return [] if seq is None else self._create_item(e, seq)
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

    def cut_for_handover(self) -> list[Action]:
        """The front end drains and ``drain_s`` is up: an answer still running is
        cancelled (``response.done{cancelled}``, reason ``server_draining``) before the
        session moves, never cut silently."""
        if not self.responses.active:
            return []
        return self._cancel("response.cancel", "server_draining", None)

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
        if isinstance(command, CloseSession | Replicate):
            return []  # logged by the runtime: the client can do nothing about it
        return self.error(exc, command.event_id)
