"""A live session on the server side, whatever its transport: the protocol core, its
journal, its input lane and its engine tasks.

:class:`LiveSession` outlives its transports. It sees the one attached through the
:class:`~duplex_server.session.attach.Attachment` interface and imports no transport. Its tasks (the
engine pump: engine session events -> core; the caller: the session's one ordered mailbox of
engine calls) run in one task group owned by the session (:meth:`LiveSession.run`). It
executes the core's actions; open, resume, takeover and slow-client handling are the core's
decisions.

Input path: raw audio from the transport goes straight into the session's input lane
(decode, resample, VAD off the loop); the processed audio reaches the core once
(``on_input_audio``) and its appends are queued in order behind the calls decided before.

Its engine calls are made by :mod:`duplex_server.session.engine_calls`; the
:class:`~duplex_server.session.registry.Sessions` registry opens and resumes sessions for any
transport.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Literal

import msgspec

from duplex_contract.control import ResumeCall
from duplex_contract.errors import ControlError, EngineDeadError, EngineError
from duplex_contract.events import AudioChunk
from duplex_contract.fence import Fence
from duplex_server.ops.metrics import Metrics
from duplex_server.ops.tracing import SessionTrace
from duplex_server.protocol import events as ev
from duplex_server.protocol.codec import (
    decode_client_event,
    encode_audio_b64,
    encode_server_event,
)
from duplex_server.protocol.commands import (
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
    ProcessAudio,
    PurgeAudio,
    Release,
    Replay,
    Replicate,
    Send,
    SendAudio,
    SendStamped,
    Takeover,
    Touch,
)
from duplex_server.protocol.errors import ProtocolError
from duplex_server.protocol.machine import SessionMachine
from duplex_server.protocol.resume import new_resume_token
from duplex_server.protocol.vad import VadEvent
from duplex_server.session import snapshot as replica
from duplex_server.session.attach import Attachment, Journal, Outgoing, Stamper
from duplex_server.session.engine_calls import CallQueue, EngineSessions, execute
from duplex_server.session.input_lane import InputLane, InputScheduler
from duplex_server.session.output_audio import OutputEncoder

log = logging.getLogger(__name__)


def now_ms() -> float:
    return time.monotonic() * 1000.0


@dataclass(frozen=True)
class SessionLimits:
    journal_max_bytes: int
    journal_max_age_s: float
    input_backlog_bytes: int
    vad_backend: Literal["silero", "energy"]


class LiveSession:
    def __init__(
        self,
        engine: EngineSessions,
        core: SessionMachine,
        limits: SessionLimits,
        inputs: InputScheduler,
        metrics: Metrics,
    ) -> None:
        self.engine = engine
        self.core = core
        self.journal = Journal(limits.journal_max_bytes, limits.journal_max_age_s)
        self.output = OutputEncoder()  # reply audio -> the output format, once
        self.stamper = Stamper(core.session_id, self.journal)
        self.stamper.beta = core.config.beta
        self.metrics = metrics
        self.attachment: Attachment | None = None
        self.lane = InputLane(
            inputs, limits.vad_backend, limits.input_backlog_bytes, self._processed, self._failed
        )
        self._calls = CallQueue()
        self.cancel_t: float | None = None
        self.commit_t: float | None = None
        self._last_words = False
        self._first_sent: dict[str, float] = {}  # response id -> first audio delta written
        self.trace: SessionTrace | None = None  # its trace, when traced (server.otel)
        self._replicated_config = core.config  # the config the engine's replica has
        #: the seq of this front end's session.handover (a drain), 0: not handed over
        self.handed_over_at = 0

    @property
    def session_id(self) -> str:
        return self.core.session_id

    @property
    def calls_waiting(self) -> int:
        """Engine calls queued and not yet made."""
        return len(self._calls)

    @property
    def input_bytes(self) -> int:
        """Input audio held here: the lane's backlog and appends queued for the engine."""
        return self.lane.backlog + self._calls.nbytes

    # ------------------------------------------------------------------ called by transports
    async def open(self, attachment: Attachment, capabilities: ev.Capabilities) -> None:
        token, digest = new_resume_token()
        self.core.resumption.token_hash = digest
        await self.replicate()  # before the client holds the token (failover, docs/scale.md)
        self.attachment = attachment
        self.apply(self.core.opened(token, capabilities, token_hash=digest))

    def replica(self, *, handed_over_at: int = 0) -> bytes:
        """This session's state for the engine to keep (duplex_server/session/snapshot.py);
        ``handed_over_at``: the seq of the session.handover that ends this front end's part."""
        self._replicated_config = self.core.config
        if handed_over_at:
            return replica.encode(self.core, handed_over_at, handed_over=True)
        return replica.encode(self.core, self.stamper.seq)

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
                self._takeover()
            elif isinstance(action, Replay):
                self.attachment = attachment
                frames = self.journal.replay_after(action.after_seq, time.monotonic())
                self.apply(core.replayed(frames, self.journal.first_available, self.stamper.seq))

    def receive_text(self, text: str) -> None:
        try:
            event = decode_client_event(text)
        except ProtocolError as exc:
            self.apply(self.core.error(exc))
            return
        self.apply(self.core.on_client_event(event, now_ms()))

    def receive_audio(self, data: bytes) -> None:
        """Raw audio in the session's input format (an RTP payload, a media stream...)."""
        if data and not self.core.closed:
            self._input(data)

    def receive_audio_frame(self, data: bytes) -> None:
        """A client's binary WebSocket frame: whole samples, or refused (and dropped)."""
        try:
            self.core.config.input_format.check_frame(len(data))
        except ProtocolError as exc:
            self.apply(self.core.error(exc))
            return
        if data and not self.core.closed:
            self.core.frame_received(len(data))
        self.receive_audio(data)

    def receive_dtmf(self, digit: str, received_at: int) -> None:
        """A keypad digit from a phone transport; ``received_at``: Unix time (s)."""
        self.apply(self.core.on_dtmf(digit, received_at, now_ms()))

    def fail(self, exc: ProtocolError) -> None:
        """The transport refused input for a reason of its own (e.g. a frame too large)."""
        self.apply(self.core.error(exc))

    def too_slow(self) -> None:
        self.apply(self.core.too_slow())

    def detach(self, attachment: Attachment) -> None:
        """The transport went away (it may resume): journal what it never wrote."""
        if self.attachment is not attachment:
            return
        self._journal_unsent(attachment)
        self.attachment = None
        if not self.core.closed:
            self._calls.put_nowait(Touch(self.core.epoch, "detach"))

    def peer_closed(self, attachment: Attachment) -> None:
        """The client closed its transport normally (WebSocket 1000) without
        ``session.close``: it is done, so the session ends now instead of waiting out the
        grace period (a client that means to resume drops or closes with another code)."""
        if self.attachment is not attachment:
            return
        attachment.take_unsent()
        self.attachment = None
        self.apply(self.core.close("client_closed_socket"))

    def next_frame(self, item: Outgoing) -> bytes | None:
        """A transport is about to write ``item``: stamp (and journal) it, or None if stale."""
        if item.raw is not None:
            return item.raw
        assert item.event is not None
        if item.epoch is not None and item.epoch < self.core.epoch:
            self.metrics.stale_dropped.labels("writer").inc()
            return None  # third drop: never a byte of a cancelled response
        return self.stamper.stamp(item.event, time.monotonic())

    def sent(self, item: Outgoing) -> None:
        """A transport wrote ``item`` (latency metrics)."""
        event, metrics, now = item.event, self.metrics, time.perf_counter()
        if isinstance(event, ev.AudioDelta):
            self._first_sent.setdefault(event.response_id, now_ms())
            if item.t_in:
                metrics.chunk_overhead.observe(now - item.t_in)
            if self.commit_t is not None:
                metrics.ttfa.observe(now - self.commit_t)
                self.commit_t = None
        elif isinstance(event, ev.ResponseDone) and event.response.status == "cancelled":
            if self.cancel_t is not None:
                metrics.bargein.observe(now - self.cancel_t)
                self.cancel_t = None

    # ------------------------------------------------------------------ actions
    def apply(self, actions: list[Action], *, t_in: float = 0.0) -> None:
        for action in actions:
            att = self.attachment
            if isinstance(action, Send):
                self.emit(action.event, t_in=t_in)
            elif isinstance(action, SendAudio):
                fmt = self.core.config.output_format
                pcm, data = self.output.encode(action.pcm, action.sample_rate, fmt)
                delta = ev.AudioDelta(
                    response_id=action.response_id,
                    item_id=action.item_id,
                    delta=encode_audio_b64(data),
                    epoch=action.epoch,
                    audio_start_ms=action.audio_start_ms,
                    duration_ms=action.duration_ms,
                )
                self.emit(delta, t_in=t_in, pcm=pcm)
            elif isinstance(action, Call):
                cmd = action.command
                if isinstance(cmd, Cancel):
                    self.cancel_t = time.perf_counter()
                elif isinstance(cmd, Commit) and cmd.respond:
                    self.commit_t = time.perf_counter()
                if self.trace is not None:
                    cmd = self.trace.command(cmd)  # a commit or pause carries its turn's
                self._calls.put_nowait(cmd)
            elif isinstance(action, ProcessAudio):
                self._input(action.data)
            elif isinstance(action, ConfigureInput):
                self.lane.configure(action.format, action.turn_detection, action.noise_reduction)
            elif isinstance(action, PurgeAudio):
                dropped = att.purge_audio(action.epoch) if att is not None else 0
                if dropped:
                    self.metrics.stale_dropped.labels("queue").inc(dropped)
            elif isinstance(action, AckJournal):
                self.journal.ack(action.seq)
            elif isinstance(action, SendStamped):
                if att is not None:
                    for data in action.frames:
                        att.send_stamped(data)
            elif isinstance(action, DropOutput):
                if att is not None:
                    att.take_unsent()
                    self._last_words = True  # what follows is stamped now, never refused
            elif isinstance(action, CloseSocket):
                if att is not None:
                    att.close(action.code, action.reason)
            elif isinstance(action, Release):
                self.attachment = None
                self._last_words = False
        if self.core.config is not self._replicated_config and not self.core.closed:
            self._calls.put_nowait(Replicate(self.replica()))  # a session.update

    def _timed(self, event: ev.ResponseDone) -> ev.ResponseDone:
        """response.done with the first audio delta's write moment, and the segments
        observed in the ``duplex_turn_segment_seconds`` histograms."""
        resp = event.response
        sent = self._first_sent.pop(resp.id, None)
        self._first_sent.clear()  # one response at a time: older entries are stale
        timing = resp.timing
        if timing is None:
            return event
        if sent is not None:
            moments, segs = dict(timing.moments_ms), dict(timing.segments_ms)
            # moments are relative to the response's origin: rebase the write time
            base = self.core.responses.origin.pop(resp.id, None)
            if base is not None:
                moments["first_audio_sent"] = round(sent - base, 1)
                if "first_audio" in moments:
                    segs["send"] = round(moments["first_audio_sent"] - moments["first_audio"], 1)
                segs["server_total"] = moments["first_audio_sent"]
            timing = ev.ResponseTiming(moments_ms=moments, segments_ms=segs)
            event = msgspec.structs.replace(
                event, response=msgspec.structs.replace(resp, timing=timing)
            )
        if resp.status == "completed" or "first_audio_sent" in timing.moments_ms:
            for name, ms in timing.segments_ms.items():
                self.metrics.turn_segment.labels(name).observe(max(0.0, ms) / 1000)
        return event

    def emit(self, event: ev.ServerEvent, *, t_in: float = 0.0, pcm: bytes = b"") -> None:
        """Queue ``event`` for the attached transport (``pcm``: an audio delta's audio as
        PCM16 at the output rate, for a media transport), or journal it if none is."""
        if self.handed_over_at and self.handed_over_at == self.stamper.seq:
            # an event after the handover never reaches the client: the replica says so,
            # and a front end taking the session over sends session.resync_required
            self._calls.put_nowait(Replicate(self.replica()))
            self.handed_over_at = -1
        trace = self.trace
        if isinstance(event, ev.ResponseDone):
            origin = self.core.responses.origin.get(event.response.id)
            event = self._timed(event)
            if trace is not None:
                trace.response_done(event, origin)
            if event.response.usage is not None:
                self.metrics.count_usage(event.response.usage)
        elif isinstance(event, ev.SessionClosed) and event.usage is not None:
            # the one record of a media call's usage (its events never reach a client)
            u = event.usage
            log.info(
                "%s: closed (%s): %d responses, %d tokens in, %d out, audio %.1f s in, %.1f s out",
                self.session_id,
                event.reason,
                u.responses,
                u.input_tokens,
                u.output_tokens,
                u.input_audio_seconds,
                u.output_audio_seconds,
            )
        if trace is not None and not isinstance(event, ev.ResponseDone | ev.AudioDelta):
            trace.on_event(event, now_ms(), self.core.input.input_ms)
        if isinstance(event, ev.Error):
            self.metrics.errors.labels(event.error.code).inc()
        self.stamper.beta = self.core.config.beta
        att = self.attachment
        if att is None or self._last_words:
            data = self.stamper.stamp(event, time.monotonic())  # journaled for a resume
            if att is not None:
                att.send_stamped(data)
            return
        epoch = event.epoch if isinstance(event, ev.AudioDelta) else None
        size = len(event.delta) + 256 if isinstance(event, ev.AudioDelta) else 512
        if not att.send_event(Outgoing(event, None, size, epoch, t_in, pcm)):
            self.too_slow()

    def _takeover(self) -> None:
        old = self.attachment
        if old is None:
            return
        self._journal_unsent(old)
        seq = self.stamper.seq
        data, _ = encode_server_event(
            ev.SessionReplaced(), event_id=f"event_replaced_{seq}", seq=seq
        )
        old.replaced(data)
        self.attachment = None

    def _journal_unsent(self, att: Attachment) -> None:
        now = time.monotonic()
        for item in att.take_unsent():
            if item.event is not None:
                if item.epoch is not None and item.epoch < self.core.epoch:
                    continue
                self.stamper.stamp(item.event, now)

    def _input(self, data: bytes) -> None:
        if not self.lane.put(data):
            self.apply(self.core.input_refused())
            return
        self.core.audio_received(len(data))
        self.metrics.count_audio_in(self.core.config.input_format.duration_ms(len(data)))

    def _processed(self, pcm: bytes, vad: list[VadEvent]) -> None:
        self.apply(self.core.on_input_audio(pcm, vad, now_ms()))

    def _failed(self, exc: BaseException) -> None:
        log.error("%s: input processing failed", self.session_id, exc_info=exc)
        self.apply(self.core.input_failed())

    # ------------------------------------------------------------------ tasks
    async def run(self) -> None:
        """Serve the engine side until the engine session ends (all tasks in one group)."""
        try:
            async with asyncio.TaskGroup() as tg:
                caller = tg.create_task(self._caller(), name=f"calls:{self.session_id}")
                pump = tg.create_task(self._pump(), name=f"pump:{self.session_id}")
                pump.add_done_callback(lambda _: self._stop_caller(caller))
        finally:
            self.lane.close()

    async def _pump(self) -> None:
        try:
            async for event in self.engine.session_events(self.session_id):
                t_in = time.perf_counter() if isinstance(event, AudioChunk) else 0.0
                self.apply(self.core.on_engine_event(event, now_ms()), t_in=t_in)
        except EngineDeadError as exc:
            self.apply(self.core.error(exc))

    async def _execute(self, cmd: EngineCommand) -> Fence | None:
        """One engine call. A call refused because this front end resumed the session while
        it was in flight (the lease moved on under it; the engine changed nothing) is made
        again under the new lease: input sent before a reconnect is not lost."""
        gen = self.core.lease_generation
        try:
            return await execute(self.engine, self.core, cmd)
        except ControlError as exc:
            if exc.code != "stale_fence" or self.core.lease_generation == gen:
                raise
        return await execute(self.engine, self.core, cmd)

    def _stop_caller(self, caller: asyncio.Task[None]) -> None:
        """The engine session ended: the caller ends too, even if the cancellation is lost
        (the stopped queue wakes the caller and hands it None)."""
        self._calls.stop()
        caller.cancel()

    async def _caller(self) -> None:
        while (queued := await self._calls.get()) is not None:
            cmd = self._calls.merge_appends(queued)
            try:
                res_fence = await self._execute(cmd)
            except Exception as exc:  # every engine error is reported to the client
                if isinstance(cmd, CloseSession | Replicate):
                    log.info("%s: %s failed: %s", self.session_id, type(cmd).__name__, exc)
                    continue
                if not isinstance(exc, EngineError):  # a bug: the client sees server_error
                    log.error("%s: %s failed", self.session_id, type(cmd).__name__, exc_info=exc)
                if self.trace is not None and isinstance(cmd, Commit) and cmd.respond:
                    self.trace.turn_refused(exc)
                self.apply(self.core.on_failure(cmd, exc))
                if isinstance(exc, EngineDeadError):
                    return
                continue
            self.core.on_result(cmd, res_fence)
