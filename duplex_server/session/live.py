"""A live session on the server side, whatever its transport: the protocol core and the
objects that carry out its actions.

:class:`LiveSession` outlives its transports. It sees the one attached through the
:class:`~duplex_server.session.attach.Attachment` interface and imports no transport. It
executes the core's actions (:meth:`LiveSession.apply`), each on the object whose job it is:

* :class:`~duplex_server.session.outlet.Outlet`: the attached transport, stamping and the
  journal (events out, takeover, detach);
* :class:`~duplex_server.session.output_audio.OutputEncoder`: the core's reply audio
  (``SendAudio``) encoded once into the output format: the ``response.output_audio.delta``
  and, beside it, its PCM16 for a media transport (which decodes nothing);
* :class:`~duplex_server.session.audio_input.AudioInput` (:attr:`LiveSession.audio`: the
  transports hand it their audio): raw audio into the session's input lane (decode,
  resample, VAD off the loop); the processed audio reaches the core once
  (``on_input_audio``) and its appends are queued in order behind the calls decided before;
* the session's one ordered mailbox of engine calls
  (:class:`~duplex_server.session.engine_calls.CallQueue`), made by
  :class:`~duplex_server.session.engine_tasks.EngineTasks`, which also pumps the engine
  session's events into the core; both tasks run in one task group (:meth:`LiveSession.run`);
* :class:`~duplex_server.session.meter.SessionMeter`: latency, usage and error metrics;
* :class:`~duplex_server.session.speech_words.SpeechWords`: the words of the user's speech
  over an answer, transcribed for the interruption decision (``TranscribeSpeech``).

A media transport reports its far end's playout (``Queued``, ``Played``, ``Flushed``) through
:meth:`LiveSession.report_playout`; the core keeps the playout state and decides what follows.
Open, resume, takeover and slow-client handling are the core's decisions. The
:class:`~duplex_server.session.registry.Sessions` registry opens, resumes and adopts sessions
for any transport.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Protocol

from duplex_contract.control import ResumeCall
from duplex_contract.errors import EngineError
from duplex_server.ops.metrics import Metrics
from duplex_server.ops.tracing import SessionTrace
from duplex_server.protocol import events as ev
from duplex_server.protocol.codec import decode_client_event
from duplex_server.protocol.commands import (
    AckJournal,
    Action,
    Call,
    CloseSocket,
    ConfigureInput,
    DropOutput,
    EndTurn,
    JudgeWords,
    ProcessAudio,
    PurgeAudio,
    Release,
    Replay,
    Replicate,
    Resync,
    Send,
    SendAudio,
    SendStamped,
    Takeover,
    Touch,
    TranscribeSpeech,
)
from duplex_server.protocol.errors import ProtocolError
from duplex_server.protocol.machine import SessionMachine
from duplex_server.protocol.playout import PlayoutReport
from duplex_server.protocol.resume import new_resume_token
from duplex_server.session import snapshot as replica
from duplex_server.session.attach import Attachment, Journal, Outgoing, Stamper
from duplex_server.session.audio_input import AudioInput
from duplex_server.session.engine_calls import (
    CallQueue,
    EngineSessions,
    WithOperations,
    execute,
)
from duplex_server.session.engine_tasks import EngineTasks
from duplex_server.session.input_lane import InputScheduler
from duplex_server.session.input_processor import VadBackend
from duplex_server.session.meter import SessionMeter
from duplex_server.session.outlet import Outlet
from duplex_server.session.output_audio import OutputEncoder
from duplex_server.session.speech_words import SpeechWords
from duplex_server.session.turn_words import TurnWords

log = logging.getLogger(__name__)


def now_ms() -> float:
    return time.monotonic() * 1000.0


def log_usage(session_id: str, reason: str, u: ev.SessionUsage) -> None:
    """The one record of a media call's usage (its events never reach a client)."""
    log.info(
        "%s: closed (%s): %d responses, %d tokens in, %d out, audio %.1f s in, %.1f s out",
        session_id,
        reason,
        u.responses,
        u.input_tokens,
        u.output_tokens,
        u.input_audio_seconds,
        u.output_audio_seconds,
    )


class WireAdapter(Protocol):
    """A session on another wire than Realtime's: the core's actions as that wire has them
    (GPT-Live: duplex_server/session/live_runtime.py)."""

    def translate(self, actions: list[Action]) -> list[Action]: ...

    def state(self) -> bytes:
        """What the replica keeps of the wire, for a front end taking the session over."""
        ...


@dataclass(frozen=True)
class SessionLimits:
    journal_max_bytes: int
    journal_max_age_s: float
    input_backlog_bytes: int
    vad_backend: VadBackend


class LiveSession:
    """One session: its core, and the objects that carry out the core's actions.

    ``event_seq``: a session taken over from another front end numbers its events on after
    it; ``trace``: its trace, when traced (``server.otel``)."""

    def __init__(
        self,
        engine: EngineSessions,
        core: SessionMachine,
        limits: SessionLimits,
        inputs: InputScheduler,
        metrics: Metrics,
        *,
        event_seq: int = 0,
        trace: SessionTrace | None = None,
    ) -> None:
        self.engine = WithOperations(engine)  # every call with its operation_id
        self.core = core
        self.metrics = metrics
        self.trace = trace
        self.stamper = Stamper(
            core.session_id, Journal(limits.journal_max_bytes, limits.journal_max_age_s)
        )
        self.stamper.beta = core.config.beta
        if event_seq:
            self.stamper.restart_at(event_seq)
        self.outlet = Outlet(self.stamper)
        self.output = OutputEncoder()  # reply audio -> the output format, once
        self.audio = AudioInput(
            core,
            inputs,
            vad_backend=limits.vad_backend,
            max_backlog=limits.input_backlog_bytes,
            metrics=metrics,
            apply=self.apply,
            clock=now_ms,
            on_barrier=self._barrier_passed,
        )
        #: client events waiting for the input lane: a commit or clear of the input buffer
        #: (first) waits until the audio sent before it is processed; what came after it
        #: waits behind it, in order (None: nothing waits)
        self._held: list[ev.AnyClientEvent] | None = None
        self.meter = SessionMeter(core.session_id, metrics)
        self._calls = CallQueue()
        #: the words of speech over an answer (the interruption decision's)
        self.words = SpeechWords(engine, core, self.apply, now_ms)
        #: the verdicts on pause guesses' words (turn detection's ``end_of_turn: words``)
        self.turn_words = TurnWords(core, self.apply)
        self._replicated_config = core.config  # the config the engine's replica has
        #: the seq of this front end's session.handover (a drain), 0: not handed over
        self.handed_over_at = 0
        #: the wire protocol (``realtime``, or ``live``: GPT-Live), for metrics
        self.protocol = "realtime"
        #: the wire adapter of a session on another wire than Realtime's (GPT-Live:
        #: duplex_server/session/live_runtime.py): every batch of the core's actions passes
        #: through it before it is carried out
        self.adapter: WireAdapter | None = None

    @property
    def session_id(self) -> str:
        return self.core.session_id

    @property
    def attachment(self) -> Attachment | None:
        """The transport attached now (None: detached)."""
        return self.outlet.attachment

    @property
    def journal(self) -> Journal:
        return self.stamper.journal

    @property
    def calls_waiting(self) -> int:
        """Engine calls queued or under way (not yet answered): a replica written now
        directly could otherwise be overwritten by an older one still on its way."""
        return len(self._calls) + self._calls.running

    @property
    def input_bytes(self) -> int:
        """Input audio held here: the lane's backlog and appends queued for the engine."""
        return self.audio.backlog + self._calls.nbytes

    # ------------------------------------------------------------------ opening
    async def open(self, attachment: Attachment, capabilities: ev.Capabilities) -> None:
        token, digest = new_resume_token()
        self.core.resumption.token_hash = digest
        await self.replicate()  # before the client holds the token (failover, docs/scale.md)
        self.outlet.attach(attachment)
        self.apply(self.core.opened(token, capabilities, token_hash=digest))

    def replica(self, *, handed_over_at: int = 0) -> bytes:
        """This session's state for the engine to keep (duplex_server/session/snapshot.py);
        ``handed_over_at``: the seq of the session.handover that ends this front end's part."""
        self._replicated_config = self.core.config
        wire = self.adapter.state() if self.adapter is not None else b""
        if handed_over_at:
            return replica.encode(self.core, handed_over_at, handed_over=True, wire=wire)
        return replica.encode(self.core, self.stamper.seq, wire=wire)

    async def replicate(self, *, handed_over_at: int = 0) -> None:
        """Keep :meth:`replica` in the engine now; a failure only costs failover."""
        state = self.replica(handed_over_at=handed_over_at)
        try:
            await execute(self.engine, self.core, Replicate(state))
        except EngineError as exc:
            log.warning("%s: replica not kept: %s", self.session_id, exc)

    async def resume(self, attachment: Attachment, req: ev.SessionResume) -> None:
        """Raises :class:`SessionFatal` (or an engine error) if the core refuses."""
        core = self.core
        core.admit_resume(req.resume_token)
        try:
            res = await self.engine.call(ResumeCall(self.session_id, core.lease_generation))
        except BaseException:
            core.resumption.resume_failed()
            raise
        if self.trace is not None:
            self.trace.resumed(res.lease_generation)
        token, digest = new_resume_token()
        actions = core.resumed(
            res.lease_generation,
            token,
            digest,
            after_seq=req.last_received_server_event_seq,
            attached=self.attachment is not None,
        )
        await self.replicate()  # the new token, before the client holds it
        for action in actions:  # Takeover first: the old transport's output is journaled
            if isinstance(action, Takeover):
                self.outlet.take_over(core.epoch)
            elif isinstance(action, Replay):
                self.outlet.attach(attachment)
                frames = self.journal.replay_after(action.after_seq, time.monotonic())
                self.apply(core.replayed(frames, self.journal.first_available, self.stamper.seq))

    def adopted(self, attachment: Attachment, actions: list[Action]) -> None:
        """A session taken over from another front end: ``attachment`` is attached and the
        core's ``taken_over`` actions carried out."""
        self.outlet.attach(attachment)
        self.apply(actions)

    # ------------------------------------------------------------------ called by transports
    def receive_text(self, text: str) -> None:
        try:
            event = decode_client_event(text)
        except ProtocolError as exc:
            self.apply(self.core.error(exc))
            return
        self._client_event(event)

    def _client_event(self, event: ev.AnyClientEvent) -> None:
        """A commit or clear of the input buffer covers all the audio sent before it: while
        the input lane has some of it (queued, in a job, or held back by the resampler) the
        event waits for it (:meth:`InputLane.barrier`), and later events wait behind it."""
        if self._held is not None:
            self._held.append(event)
            return
        if isinstance(event, ev.InputAudioBufferCommit | ev.InputAudioBufferClear) and not (
            self.audio.lane.settled
        ):
            self._held = [event]
            self.audio.lane.barrier(flush=isinstance(event, ev.InputAudioBufferCommit))
            return
        self.apply(self.core.on_client_event(event, now_ms()))

    def _barrier_passed(self) -> None:
        """The audio before the waiting commit or clear is in: it, then what waited behind
        it (which may wait again, behind a later commit)."""
        held, self._held = self._held or [], None
        if not held:
            return
        self.apply(self.core.on_client_event(held[0], now_ms()))
        for i, event in enumerate(held[1:], 1):
            if self._held is not None:  # a later commit waits again: the rest behind it
                self._held.extend(held[i:])
                return
            self._client_event(event)

    def receive_dtmf(self, digit: str, received_at: int) -> None:
        """A keypad digit from a phone transport; ``received_at``: Unix time (s)."""
        self.apply(self.core.on_dtmf(digit, received_at, now_ms()))

    def report_playout(self, report: PlayoutReport) -> None:
        """A media transport's report of its far end's playout (the core keeps the state
        and decides: :mod:`duplex_server.protocol.playout`)."""
        self.apply(self.core.on_playout(report, now_ms()))

    def fail(self, exc: ProtocolError) -> None:
        """The transport refused input for a reason of its own (e.g. a frame too large)."""
        self.apply(self.core.error(exc))

    def too_slow(self) -> None:
        self.apply(self.core.too_slow())

    def detach(self, attachment: Attachment) -> None:
        """The transport went away (it may resume): journal what it never wrote."""
        if self.outlet.detach(attachment, self.core.epoch) and not self.core.closed:
            self._calls.put_nowait(Touch(self.core.epoch, "detach"))

    def peer_closed(self, attachment: Attachment) -> None:
        """The client closed its transport normally (WebSocket 1000) without
        ``session.close``: it is done, so the session ends now instead of waiting out the
        grace period (a client that means to resume drops or closes with another code)."""
        if self.outlet.let_go(attachment):
            self.apply(self.core.close("client_closed_socket"))

    def next_frame(self, item: Outgoing) -> bytes | None:
        """A transport is about to write ``item``: stamp (and journal) it, or None if stale."""
        if item.raw is None and item.epoch is not None and item.epoch < self.core.epoch:
            self.metrics.stale_dropped.labels("writer").inc()
            return None  # third drop: never a byte of a cancelled response
        return self.outlet.next_frame(item)

    def sent(self, item: Outgoing) -> None:
        """A transport wrote ``item`` (latency metrics)."""
        self.meter.sent(item, time.perf_counter(), now_ms())

    # ------------------------------------------------------------------ actions
    def apply(self, actions: list[Action], *, t_in: float = 0.0) -> None:
        """Carry out the core's ``actions``, each by the object whose job it is."""
        if self.adapter is not None:
            actions = self.adapter.translate(actions)
        outlet = self.outlet
        for action in actions:
            if isinstance(action, Send):
                self.emit(action.event, t_in=t_in)
            elif isinstance(action, SendAudio):  # encoded once, here
                delta, pcm = self.output.delta(action, self.core.config.output_format)
                self.emit(delta, t_in=t_in, pcm=pcm)
            elif isinstance(action, Call):
                cmd = action.command
                self.meter.called(cmd, time.perf_counter())
                if self.trace is not None:
                    cmd = self.trace.command(cmd)  # a commit or pause carries its turn's
                self._calls.put_nowait(cmd)
            elif isinstance(action, ProcessAudio):
                self.audio.put(action.data)
            elif isinstance(action, ConfigureInput):
                self.audio.configure(action)
                td = action.turn_detection
                if td is not None and td.end_of_turn == "words":
                    self.turn_words.warm()
            elif isinstance(action, TranscribeSpeech):
                self.words.ask(action)
            elif isinstance(action, JudgeWords):
                self.turn_words.judge(action)
            elif isinstance(action, EndTurn):
                self.audio.lane.end_turn(action.pause_at_ms)
            elif isinstance(action, PurgeAudio):
                dropped = outlet.purge_audio(action.epoch)
                if dropped:
                    self.metrics.stale_dropped.labels("queue").inc(dropped)
            elif isinstance(action, AckJournal):
                self.journal.ack(action.seq)
            elif isinstance(action, SendStamped):
                outlet.send_stamped(action.frames)
            elif isinstance(action, DropOutput):
                outlet.drop_output()
            elif isinstance(action, CloseSocket):
                outlet.close(action.code, action.reason)
            elif isinstance(action, Release):
                outlet.release()
            elif isinstance(action, Resync):
                seq = self.stamper.seq
                event = ev.ResyncRequired(
                    reason=action.reason, first_available_seq=seq + 1, last_seq=seq
                )
                self.emit(event)
        if self.core.closed:
            return
        if self.core.config is not self._replicated_config:
            self._calls.put_nowait(Replicate(self.replica()))  # a session.update
        if self.core.items.changed:  # kept in the engine beside the conversation
            self._calls.put_nowait(replica.item_changes(self.core))

    def emit(self, event: ev.ServerEvent, *, t_in: float = 0.0, pcm: bytes = b"") -> None:
        """Send ``event`` to the client (measured, traced, stamped when written); ``pcm``:
        an audio delta's audio as PCM16 at the output rate, for a media transport."""
        if self.handed_over_at and isinstance(event, ev.HeartbeatAck):
            return  # the socket is closing and the client resumes elsewhere: an ack after
            # the handover carries nothing a taker needs, and must not make it say resync
        if self.handed_over_at and self.handed_over_at == self.stamper.seq:
            # an event after the handover never reaches the client: the replica says so,
            # and a front end taking the session over sends session.resync_required
            self._calls.put_nowait(Replicate(self.replica()))
            self.handed_over_at = -1
        trace = self.trace
        if isinstance(event, ev.ResponseDone):
            origin = self.core.responses.origin.get(event.response.id)
            event = self.meter.response_done(event, self.core.responses.origin)
            if trace is not None:
                trace.response_done(event, origin)
        else:
            self.meter.observe(event)
            if isinstance(event, ev.SessionClosed) and event.usage is not None:
                log_usage(self.session_id, event.reason, event.usage)
            if trace is not None and not isinstance(event, ev.AudioDelta):
                trace.on_event(event, now_ms(), self.core.input.input_ms)
        if not self.outlet.send(event, beta=self.core.config.beta, t_in=t_in, pcm=pcm):
            self.too_slow()

    # ------------------------------------------------------------------ tasks
    async def run(self) -> None:
        """Serve the engine side until the engine session ends (all tasks in one group)."""
        tasks = EngineTasks(
            self.engine,
            self.core,
            self._calls,
            apply=self.apply,
            clock=now_ms,
            trace=self.trace,
        )
        try:
            await tasks.run()
        finally:
            self.audio.close()
            await self.words.aclose()
            await self.turn_words.aclose()
