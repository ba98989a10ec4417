"""The per-session protocol state machine (sans-I/O).

:class:`SessionMachine` takes parsed client events, processed input audio (with VAD
decisions), engine session events, engine call results and playout reports from a media
transport, each with the current time in milliseconds passed in, and returns
:mod:`~duplex_server.protocol.commands` actions: server events and reply audio to send,
engine calls to make, local actions. It never awaits, never touches a socket and never
reads the clock. The session runtime (``duplex_server.session.live``) executes actions in
order and makes no protocol decisions of its own; that includes opening, resuming and
taking a session over and ending it for a slow client, all decided here.

It is made of parts, each with its own job and tests, which it holds and joins:

- :class:`~duplex_server.protocol.position.EnginePosition` (:attr:`SessionMachine.position`):
  the epoch and the engine's turn and response counters;
- :class:`~duplex_server.protocol.resumption.Resumption` (:attr:`SessionMachine.resumption`):
  the resume token and the open / resume / takeover handshake;
- :class:`~duplex_server.protocol.client_input.ClientInput` (:attr:`SessionMachine.input`):
  input audio and its VAD steps, commits, items, ``session.update``, DTMF, idle timeout;
- :class:`~duplex_server.protocol.response_tracker.ResponseTracker`
  (:attr:`SessionMachine.responses`): engine output -> response events, cancel, barge-in;
- :class:`~duplex_server.protocol.playout.Playout` (:attr:`SessionMachine.playout`): the
  reply audio emitted and what a media transport's far end reported of it;
- and the shared records: the conversation (:mod:`~duplex_server.protocol.items`), the
  input numbering (:mod:`~duplex_server.protocol.input_seq`), the usage meter and the turn
  timeline (:mod:`~duplex_server.protocol.timeline`).

The machine owns the session's identity, configuration, lease generation and ``closed``;
it dispatches client and engine events to its parts, adopts call results, and is the one
place an exception becomes actions (:meth:`SessionMachine.error`) and a session closes
(:meth:`SessionMachine.close`).

Epochs: every cancel advances the epoch at once (the engine accepts exactly one epoch step
per cancel), so output of an older epoch is dropped here before it becomes an event, queued
audio below the epoch is purged (:class:`PurgeAudio`), and the writer checks
:attr:`SessionMachine.epoch` again before each audio frame.
"""

from __future__ import annotations

from collections.abc import Sequence

from duplex_contract.errors import ControlError
from duplex_contract.fence import Fence
from duplex_contract.session_events import SessionEvent, SessionLifecycle, UserTranscript
from duplex_server.protocol import events as ev
from duplex_server.protocol.client_input import ClientInput, InputEvent
from duplex_server.protocol.commands import (
    UNFENCED,
    AckJournal,
    Action,
    Call,
    Cancel,
    CloseSession,
    CloseSocket,
    Commit,
    ConfigureInput,
    DropOutput,
    EngineCommand,
    Release,
    Send,
    Touch,
)
from duplex_server.protocol.errors import CloseCode, ProtocolError, SessionFatal, to_wire_error
from duplex_server.protocol.input_seq import InputSequence
from duplex_server.protocol.items import Conversation
from duplex_server.protocol.playout import FarEnd, Flushed, Playout, PlayoutReport
from duplex_server.protocol.position import EnginePosition
from duplex_server.protocol.response_tracker import ResponseEvent, ResponseTracker
from duplex_server.protocol.resumption import Resumption
from duplex_server.protocol.session_config import EffectiveSession
from duplex_server.protocol.timeline import TurnTimeline
from duplex_server.protocol.usage import UsageMeter
from duplex_server.protocol.vad_events import VadEvent


class SessionMachine:
    """One session's protocol state; survives socket changes (resume, takeover)."""

    def __init__(
        self, session_id: str, config: EffectiveSession, *, lease_generation: int = 1
    ) -> None:
        self.session_id = session_id
        self.config = config
        self.lease_generation = lease_generation
        self.closed = False
        self.now_ms = 0.0  # the time of the latest input
        self.position = EnginePosition(session_id)
        self.resumption = Resumption(session_id)
        self.items = Conversation(session_id)
        self.seqs = InputSequence()  # client input numbering (input exactly once)
        self.usage = UsageMeter()  # tokens and audio seconds (response.done, session.closed)
        self.playout = Playout()
        timeline = TurnTimeline()
        self.responses = ResponseTracker(
            self.position, self.items, self.usage, timeline, self.playout
        )
        self.input = ClientInput(
            session_id, self.position, self.items, self.seqs, self.usage, timeline, self.responses
        )
        self.barge = self.input.barge  # the speech over an answer: the interruption decision

    @property
    def epoch(self) -> int:
        return self.position.epoch

    def fence_for(self, epoch: int) -> Fence:
        """The fence an engine call decided at ``epoch`` carries when it is executed."""
        return self.position.fence_for(epoch)

    # ------------------------------------------------------------------ client events
    def on_client_event(self, event: ev.AnyClientEvent, now_ms: float) -> list[Action]:
        if self.closed:
            return []
        self.now_ms = now_ms
        try:
            return self._dispatch(event, now_ms)
        except ProtocolError as exc:
            return self.error(exc, event.event_id)

    def _dispatch(self, e: ev.AnyClientEvent, now_ms: float) -> list[Action]:
        if isinstance(e, InputEvent):
            return self.input.on_client_event(e, self.config, now_ms)
        if isinstance(e, ResponseEvent):
            return self.responses.on_client_event(e, self.config, now_ms)
        if isinstance(e, ev.SessionUpdate):
            self.config, out = self.input.update(e, self.config)
            if any(isinstance(a, ConfigureInput) for a in out):
                # a new input lane never tells an onset's pause lost: it is taken back now
                out += self.input.barge.lost(now_ms)
            return out
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

    def on_dtmf(self, digit: str, received_at: int, now_ms: float) -> list[Action]:
        """A keypad digit from a phone transport (:mod:`~duplex_server.protocol.dtmf`)."""
        if self.closed:
            return []
        self.now_ms = now_ms
        return self.input.on_dtmf(digit, received_at, self.config, now_ms)

    def frame_received(self, nbytes: int) -> None:
        """A binary audio frame of ``nbytes`` arrived: it is numbered implicitly."""
        seq = self.seqs.accept(None)
        assert seq is not None
        self.seqs.audio(seq, self.config.input_format.duration_ms(nbytes))

    def audio_received(self, nbytes: int) -> None:
        """The transport handed the session ``nbytes`` of input audio (its input format)."""
        self.usage.received(self.config.input_format.duration_ms(nbytes))

    # ------------------------------------------------------------------ input audio, playout
    def on_input_audio(self, pcm: bytes, vad: Sequence[VadEvent], now_ms: float) -> list[Action]:
        """One processed chunk (engine input rate) and the VAD decisions it produced."""
        if self.closed:
            return []
        self.now_ms = now_ms
        return self.input.on_audio(pcm, vad, self.config, now_ms)

    def on_playout(self, report: PlayoutReport, now_ms: float) -> list[Action]:
        """A media transport's report of its far end's playout
        (:mod:`~duplex_server.protocol.playout`). A flush truncates the item the far end
        was playing to what was heard, if some of it was dropped unheard."""
        if self.closed:
            return []
        self.now_ms = now_ms
        if isinstance(report, FarEnd):
            self.playout.far_end = True
            return []
        if not isinstance(report, Flushed):
            self.playout.report(report)
            return []
        cut = self.playout.flushed()
        out: list[Action] = list(self.playout.take_resumed())  # a resume waiting for it
        if cut is None:
            return out
        try:  # (whole ms, as a client's conversation.item.truncate)
            played = float(int(cut.played_ms))
            return out + self.responses.heard(cut.item_id, played, None, truncate=True)
        except ProtocolError:
            return out  # not an item of the conversation (an out-of-band response)

    # ------------------------------------------------------------------ engine events
    def on_engine_event(self, event: SessionEvent, now_ms: float) -> list[Action]:
        self.now_ms = now_ms
        if isinstance(event, SessionLifecycle):
            if event.state == "expiring":
                return [Send(ev.SessionExpiring(in_s=event.in_s or 0.0, reason=event.reason))]
            if event.state == "restored":  # the engine restarted (docs/scale.md)
                if self.closed:
                    return []
                return self.responses.engine_restarted(event.dropped, self.config, now_ms)
            if self.closed and event.state == "closed":
                return []
            self.closed = True
            return _ended(event, self.usage.total())
        if self.closed or event.fence.epoch < self.epoch:
            return []  # stale: a cancelled epoch's output never becomes an event
        if isinstance(event, UserTranscript):
            return self.input.on_transcript(event, now_ms)
        return self.responses.on_engine_event(event, self.config, now_ms)

    def cut_for_handover(self, reason: str = "server_draining") -> list[Action]:
        """The front end drains and ``drain_s`` is up: an answer still running is
        cancelled (``response.done{cancelled}``, ``reason``: ``server_draining``, or
        ``server_shutdown`` when the server stops for good) before the session moves or
        ends, never cut silently."""
        if not self.responses.active:
            return []
        return self.responses.cancel("response.cancel", reason, None, self.now_ms)

    # ------------------------------------------------------------------ call results
    def on_result(self, command: EngineCommand, accepted: Fence | None) -> None:
        """An engine call succeeded; adopt the engine's turn and response counters."""
        if accepted is None:
            return
        if isinstance(command, Commit) and command.item_id is not None:
            self.items.commit_accepted(command.item_id, accepted.turn_id)
        self.position.accepted(accepted)

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
        if isinstance(command, UNFENCED):
            return []  # logged by the runtime: the client can do nothing about it
        return self.error(exc, command.event_id)

    # ------------------------------------------------------------------ errors, close
    def error(self, exc: BaseException, event_id: str | None = None) -> list[Action]:
        """The one place an exception becomes actions: the error event, maybe a close."""
        detail, close = to_wire_error(exc, event_id=event_id)
        out: list[Action] = [Send(ev.Error(error=detail))]
        if close is not None:
            out.append(CloseSocket(close, detail.code))
        return out

    def close(self, reason: str, notice: SessionFatal | None = None) -> list[Action]:
        """End the session: ``session.closed{reason}``, close 1000. ``notice``: the error
        that says why, sent first, and its close code (the server stopping for good:
        ``server_shutdown``, 1001)."""
        if self.closed:
            return []
        self.closed = True
        out: list[Action] = [Call(CloseSession(reason))]
        code: int = CloseCode.NORMAL
        if notice is not None:
            detail, close = to_wire_error(notice)
            out.append(Send(ev.Error(error=detail)))
            code = close or code
        out.append(Send(ev.SessionClosed(reason=reason, usage=self.usage.total())))
        out.append(CloseSocket(code, reason))
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

    # ------------------------------------------------------------------ attachments
    def opened(
        self, resume_token: str, capabilities: ev.Capabilities, *, token_hash: bytes = b""
    ) -> list[Action]:
        """The session was opened for its first transport."""
        return self.resumption.opened(self.config, resume_token, capabilities, token_hash)

    def admit_resume(self, token: str) -> None:
        """May a new transport resume this session? Raises :class:`SessionFatal` if not;
        else the session is resuming until :meth:`resumed` or
        ``resumption.resume_failed``."""
        self.resumption.admit(token, closed=self.closed)

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
        self.lease_generation = lease_generation
        return self.resumption.resumed(token, token_hash, after_seq=after_seq, attached=attached)

    def replayed(
        self, frames: list[bytes] | None, first_available: int, last_seq: int
    ) -> list[Action]:
        """What the journal had after the resume point (``None``: some of it was lost)."""
        return self.resumption.replayed(
            frames,
            first_available,
            last_seq,
            lease_generation=self.lease_generation,
            last_input_seq=self.seqs.received,
        )

    def adopted(self, position: Fence, engine_input_seq: int, token_hash: bytes) -> None:
        """This front end takes the session over from one that is gone (a crash, a drain):
        it continues at the engine's position, with the input the engine has."""
        self.position.adopt(position)
        self.seqs.adopt(engine_input_seq)
        self.resumption.token_hash = token_hash

    def taken_over(self, token: str, *, last_seq: int, lost: bool) -> list[Action]:
        """What the client is told after :meth:`adopted` (``lost``: events after the
        client's last one may be lost, docs/scale.md)."""
        return self.resumption.taken_over(
            self.config,
            token,
            last_seq=last_seq,
            lost=lost,
            lease_generation=self.lease_generation,
            last_input_seq=self.seqs.received,
        )


def _ended(event: SessionLifecycle, usage: ev.SessionUsage) -> list[Action]:
    """The engine ended the session (it expired, or closed): tell the client and close."""
    out: list[Action] = []
    if event.state == "expired":
        out.append(Send(ev.SessionExpired(reason=event.reason)))
    closed = ev.SessionClosed(reason=event.reason or event.state, usage=usage)
    out.append(Send(closed))
    out.append(CloseSocket(CloseCode.NORMAL, event.reason or event.state))
    return out
