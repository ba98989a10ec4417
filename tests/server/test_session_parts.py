"""The live session's parts, each alone: the outlet (session/outlet.py), the output encoder
(session/output_audio.py), the meter (session/meter.py), the audio input
(session/audio_input.py), the engine tasks (session/engine_tasks.py), the stamper's restart
(session/attach.py), a media transport's playout reports through the session
(session/live.py) and the registry's adoption of a session another front end held
(session/registry.py)."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import pytest

from audio_kit.g711 import pcm16_to_g711
from duplex_contract.control import ControlCall, ControlResult, ResumeCall
from duplex_contract.errors import ControlError, EngineDeadError
from duplex_contract.fence import Fence
from duplex_contract.session_events import SessionEvent
from duplex_server.ops.metrics import Metrics
from duplex_server.protocol import events as ev
from duplex_server.protocol.codec import PCM16_24K, ULAW
from duplex_server.protocol.commands import (
    Cancel,
    CloseSession,
    Commit,
    ConfigureInput,
    SendAudio,
    Touch,
)
from duplex_server.protocol.errors import ProtocolError, SessionFatal
from duplex_server.protocol.machine import SessionMachine
from duplex_server.protocol.playout import Flushed, Played, Queued
from duplex_server.protocol.resume import new_resume_token
from duplex_server.protocol.session_config import EffectiveSession
from duplex_server.session import engine_tasks, snapshot
from duplex_server.session.attach import Journal, Outgoing, Stamper
from duplex_server.session.audio_input import AudioInput
from duplex_server.session.engine_calls import CallQueue
from duplex_server.session.engine_tasks import EngineTasks
from duplex_server.session.input_lane import InputLane, InputScheduler
from duplex_server.session.meter import SessionMeter
from duplex_server.session.outlet import Outlet
from duplex_server.session.output_audio import OutputEncoder
from tests.server.test_runtime import SID, FakeEngine, FakeTransport, _caps, _sessions


def _stamper() -> Stamper:
    return Stamper(SID, Journal(1 << 20, 60.0))


def _delta(epoch: int) -> ev.AudioDelta:
    return ev.AudioDelta(
        response_id="resp_1",
        item_id="item_1",
        delta="AAAA",
        epoch=epoch,
        audio_start_ms=0.0,
        duration_ms=20.0,
    )


def _seqs(frames: list[bytes]) -> list[int]:
    return [int(json.loads(f)["server_event_seq"]) for f in frames]


# ---------------------------------------------------------------------------- Stamper
def test_a_restarted_stamper_numbers_on_and_replays_nothing_from_before() -> None:
    st = _stamper()
    st.restart_at(41)
    data = st.stamp(ev.InputCleared(), time.monotonic())
    assert json.loads(data)["server_event_seq"] == 42
    assert st.journal.replay_after(10, time.monotonic()) is None  # before the takeover
    assert st.journal.replay_after(41, time.monotonic()) == [data]


# ---------------------------------------------------------------------------- Outlet
def test_without_a_transport_events_are_stamped_and_journaled_at_once() -> None:
    out = Outlet(_stamper())
    assert out.send(ev.InputCleared(), beta=False)
    assert out.stamper.seq == 1 and len(out.journal.replay_after(0, time.monotonic()) or []) == 1


def test_with_a_transport_events_queue_and_are_stamped_when_written() -> None:
    out = Outlet(_stamper())
    t = FakeTransport(budget=1000)
    out.attach(t)
    assert out.send(_delta(3), beta=False, t_in=1.5)
    item = t.queue[0]
    assert item.epoch == 3 and item.t_in == 1.5 and item.size == len("AAAA") + 256
    assert out.stamper.seq == 0  # not stamped until written
    assert json.loads(out.next_frame(item))["server_event_seq"] == 1
    assert out.next_frame(Outgoing(None, b"raw", 3)) == b"raw"
    assert out.send(ev.InputCleared(), beta=False)  # 512 bytes: fits
    assert not out.send(ev.InputCleared(), beta=False)  # over the budget: a slow client


def test_after_the_queue_is_dropped_the_last_words_are_stamped_and_never_refused() -> None:
    out = Outlet(_stamper())
    t = FakeTransport(budget=1)
    out.attach(t)
    out.send(ev.InputCleared(), beta=False)
    out.drop_output()
    assert t.queue == []
    for _ in range(3):
        assert out.send(ev.InputCleared(), beta=False)
    assert [i.raw is not None for i in t.queue] == [True, True, True]
    assert _seqs([i.raw for i in t.queue if i.raw]) == [1, 2, 3]
    out.close(1008, "client_too_slow")
    out.release()
    assert t.closed == (1008, "client_too_slow") and out.attachment is None
    assert out.send(ev.InputCleared(), beta=False)  # released: journaled only


def test_a_detach_journals_what_was_never_written_but_stale_audio() -> None:
    out = Outlet(_stamper())
    t, other = FakeTransport(), FakeTransport()
    out.attach(t)
    out.send(_delta(1), beta=False)  # a cancelled response's audio (epoch 1 < 2)
    out.send(_delta(2), beta=False)
    out.send(ev.InputCleared(), beta=False)
    assert not out.detach(other, 2)  # not the one attached: nothing happens
    assert out.detach(t, 2) and out.attachment is None and t.queue == []
    assert out.stamper.seq == 2  # the stale delta was dropped, not journaled


def test_a_takeover_replaces_the_old_transport_after_journaling_its_output() -> None:
    out = Outlet(_stamper())
    old = FakeTransport()
    out.attach(old)
    out.send(ev.InputCleared(), beta=False)
    out.take_over(0)
    assert old.closed == (1000, "replaced") and old.replaced_with is not None
    assert json.loads(old.replaced_with)["type"] == "session.replaced"
    assert out.attachment is None and out.stamper.seq == 1
    out.take_over(0)  # nobody attached: nothing to replace


def test_let_go_drops_what_was_never_written() -> None:
    out = Outlet(_stamper())
    t = FakeTransport()
    out.attach(t)
    out.send(ev.InputCleared(), beta=False)
    assert not out.let_go(FakeTransport())
    assert out.let_go(t) and t.queue == [] and out.stamper.seq == 0


def test_the_outlet_purges_and_sends_stamped_frames_on_the_transport() -> None:
    out = Outlet(_stamper())
    assert out.purge_audio(5) == 0  # nobody attached
    t = FakeTransport()
    out.attach(t)
    out.send(_delta(1), beta=False)
    out.send(_delta(2), beta=False)
    assert out.purge_audio(2) == 1
    out.send_stamped((b"a", b"b"))
    assert [i.raw for i in t.queue][-2:] == [b"a", b"b"]


def test_an_audio_delta_is_queued_with_its_pcm_for_a_media_transport() -> None:
    out = Outlet(_stamper())
    t = FakeTransport()
    out.attach(t)
    assert out.send(_delta(0), beta=False, pcm=b"\x01\x00")
    assert t.queue[0].pcm == b"\x01\x00"


# ---------------------------------------------------------------------------- OutputEncoder
def _reply(pcm: bytes, rate: int) -> SendAudio:
    return SendAudio("resp_1", "item_1", 3, pcm, rate, 40.0, 20.0)


def test_reply_audio_becomes_its_delta_and_the_pcm_a_media_transport_plays() -> None:
    pcm = bytes(range(256)) * 3  # 16 ms at 24 kHz
    delta, played = OutputEncoder().delta(_reply(pcm, 24000), PCM16_24K)
    assert played == pcm and base64.b64decode(delta.delta) == pcm  # nothing to convert
    assert (delta.response_id, delta.item_id, delta.epoch) == ("resp_1", "item_1", 3)
    assert (delta.audio_start_ms, delta.duration_ms) == (40.0, 20.0)
    enc = OutputEncoder()
    pcm8k = b"\x10\x00" * 160
    delta, played = enc.delta(_reply(pcm8k, 8000), ULAW)
    assert played == pcm8k  # already at the output rate: the PCM as sent
    assert base64.b64decode(delta.delta) == pcm16_to_g711(pcm8k, "g711_ulaw")
    _, played = enc.delta(_reply(b"\x00\x00" * 2400, 24000), ULAW)  # 100 ms, resampled
    assert 0 < len(played) <= 2 * 800


# ---------------------------------------------------------------------------- playout reports
def test_a_media_transports_playout_reports_reach_the_core_through_the_session() -> None:
    async def main() -> None:
        with ThreadPoolExecutor(1) as pool:
            sessions = await _sessions(FakeEngine(), pool)
            t = FakeTransport()
            session = await sessions.open(t, _caps(), beta=False)
            t.session = session
            core = session.core
            core.playout.emitted("resp_1", "item_1", 200.0, 24000)
            session.report_playout(Queued("item_1"))
            assert core.playout.playing() == "resp_1"
            session.report_playout(Played("item_1", 120.0, 80.0))
            position = core.playout.position()
            assert position is not None and position.played_ms == 120.0
            session.report_playout(Flushed())  # not an item of the conversation: no truncate
            assert core.playout.playing() is None
            await sessions.shutdown(1.0)

    asyncio.run(main())


# ---------------------------------------------------------------------------- SessionMeter
def _sample(m: Metrics, name: str, **labels: str) -> float:
    return m.registry.get_sample_value(name, labels) or 0.0


def _done(
    status: Literal["completed", "cancelled"], timing: ev.ResponseTiming | None
) -> ev.ResponseDone:
    obj = ev.ResponseObj(
        id="resp_1", status=status, output=[], output_modalities=["audio"], timing=timing
    )
    return ev.ResponseDone(response=obj)


def test_the_meter_times_first_audio_and_barge_in_from_the_calls_made() -> None:
    m = Metrics(lambda: None)
    meter = SessionMeter(SID, m)
    meter.called(Commit(epoch=0, respond=True), 10.0)
    audio = Outgoing(_delta(0), None, 10, 0, t_in=10.2)
    meter.sent(audio, 10.5, 1000.0)
    meter.sent(audio, 10.6, 1020.0)  # the first one counts
    assert _sample(m, "duplex_time_to_first_audio_seconds_count") == 1
    assert _sample(m, "duplex_time_to_first_audio_seconds_sum") == pytest.approx(0.5)
    assert _sample(m, "duplex_chunk_overhead_seconds_count") == 2
    meter.called(Cancel(epoch=0, event="barge_in"), 20.0)
    meter.sent(Outgoing(_done("cancelled", None), None, 10), 20.25, 2000.0)
    assert _sample(m, "duplex_bargein_stop_seconds_sum") == pytest.approx(0.25)


def test_response_done_gets_the_first_audio_write_moment_rebased_on_its_origin() -> None:
    m = Metrics(lambda: None)
    meter = SessionMeter(SID, m)
    meter.sent(Outgoing(_delta(0), None, 10, 0), 1.0, 1500.0)
    timing = ev.ResponseTiming(moments_ms={"first_audio": 400.0}, segments_ms={"llm": 100.0})
    origins = {"resp_1": 1000.0, "resp_0": 1.0}
    done = meter.response_done(_done("completed", timing), origins)
    assert done.response.timing is not None
    assert done.response.timing.moments_ms["first_audio_sent"] == 500.0
    assert done.response.timing.segments_ms == {"llm": 100.0, "send": 100.0, "server_total": 500.0}
    assert origins == {"resp_0": 1.0}  # this response's origin is taken
    assert _sample(m, "duplex_turn_segment_seconds_count", segment="send") == 1


def test_the_meter_counts_error_codes() -> None:
    m = Metrics(lambda: None)
    SessionMeter(SID, m).observe(
        ev.Error(error=ev.ErrorDetail(type="invalid_request_error", code="x", message="m"))
    )
    assert _sample(m, "duplex_errors_total", code="x") == 1


# ---------------------------------------------------------------------------- AudioInput
class FakeCore:
    """What the audio input asks of the session core, recorded."""

    def __init__(self) -> None:
        self.session_id = SID
        self.closed = False
        self.config = EffectiveSession()
        self.seen: list[str] = []
        self.audio: list[bytes] = []

    def error(self, exc: ProtocolError) -> list[Any]:
        self.seen.append(f"error:{exc.code}")
        return ["error"]

    def frame_received(self, n: int) -> None:
        self.seen.append(f"frame:{n}")

    def audio_received(self, n: int) -> None:
        self.seen.append(f"audio:{n}")

    def input_refused(self) -> list[Any]:
        self.seen.append("refused")
        return ["refused"]

    def on_input_audio(self, pcm: bytes, vad: list[Any], now_ms: float) -> list[Any]:
        self.audio.append(pcm)
        return ["processed"]

    def input_failed(self) -> list[Any]:
        return ["failed"]


def test_audio_input_queues_counts_refuses_and_hands_the_core_processed_audio() -> None:
    async def run() -> None:
        with ThreadPoolExecutor(1) as pool:
            core = FakeCore()
            applied: list[Any] = []
            audio = AudioInput(
                core,  # type: ignore[arg-type]
                InputScheduler(pool, 1),
                vad_backend="energy",  # processed on the loop: no thread hop
                max_backlog=960,
                metrics=Metrics(lambda: None),
                apply=applied.extend,
                clock=lambda: 0.0,
            )
            audio.configure(ConfigureInput(PCM16_24K, None))
            audio.receive_frame(b"\x00")  # half a sample: refused, dropped
            audio.receive_frame(b"\x00\x01" * 240)
            audio.put(b"\x00" * 960)  # over the backlog while the first waits
            assert audio.backlog == 480
            assert core.seen == ["error:invalid_audio_frame", "frame:480", "audio:480", "refused"]
            for _ in range(5):
                await asyncio.sleep(0)
            # 24 kHz comes out at once (audio_kit.fir: no block delay): 10 ms, 160 samples
            assert applied == ["error", "refused", "processed"] and audio.backlog == 0
            assert [len(a) for a in core.audio] == [320]
            audio.put(b"\x00")  # half a sample: the resampler holds it, nothing comes out,
            for _ in range(5):  # and a piece that comes out as nothing is not handed on
                await asyncio.sleep(0)
            assert applied == ["error", "refused", "processed"] and len(core.audio) == 1
            audio.receive_frame(b"\x00\x01" * 480)  # with the held byte: 480 samples whole
            for _ in range(5):
                await asyncio.sleep(0)
            assert applied == ["error", "refused", "processed", "processed"]
            assert [len(a) for a in core.audio] == [320, 640] and audio.backlog == 0
            audio.receive(b"")  # nothing
            core.closed = True
            audio.receive(b"\x00\x00")  # the session ended: dropped
            audio.close()
            audio.put(b"\x00\x00")  # after close: no core actions reach the session
            for _ in range(5):
                await asyncio.sleep(0)
            assert applied == ["error", "refused", "processed", "processed"]

    asyncio.run(run())


def test_a_barrier_waits_for_the_queued_audio_and_flushes_or_drops_what_is_held() -> None:
    """InputLane.barrier: ``on_barrier`` runs after the audio queued before it reached the
    core, with (flush) what the resampler still held of it, or (no flush: a clear) without
    it; ``settled`` says whether any audio is still on its way."""

    async def run() -> None:
        with ThreadPoolExecutor(1) as pool:
            got: list[Any] = []
            lane = InputLane(
                InputScheduler(pool, 1),
                "energy",
                1 << 20,
                lambda pcm, vad: got.append(len(pcm)),
                got.append,
                lambda: got.append("barrier"),
            )
            assert lane.settled  # nothing configured, nothing put
            lane.configure(PCM16_24K, None)
            audio = b"\x00\x01" * 24000  # 1 s at 24 kHz: 16000 samples at 16 kHz
            lane.put(audio)
            assert not lane.settled
            lane.barrier(flush=True)
            for _ in range(5):
                await asyncio.sleep(0)
            assert got[-1] == "barrier" and "barrier" not in got[:-1]
            assert sum(n for n in got if isinstance(n, int)) == 2 * 16000  # all of it came out
            assert lane.settled
            got.clear()
            lane.put(audio[:9601])  # 200 ms and half a sample
            for _ in range(5):
                await asyncio.sleep(0)
            assert not lane.settled  # the resampler holds the half sample back
            held = sum(n for n in got if isinstance(n, int))
            assert held == 2 * 3200  # (the rest came out at once)
            lane.barrier(flush=False)  # a clear: what is held is dropped
            for _ in range(5):
                await asyncio.sleep(0)
            assert got[-1] == "barrier" and sum(n for n in got if isinstance(n, int)) == held
            assert lane.settled

    asyncio.run(run())


# ---------------------------------------------------------------------------- EngineTasks
class EventsEngine:
    """An engine session whose events the test feeds (None: the session ends)."""

    def __init__(self) -> None:
        self.events: asyncio.Queue[SessionEvent | BaseException | None] = asyncio.Queue()

    async def session_events(self, session_id: str) -> AsyncIterator[SessionEvent]:
        while (event := await self.events.get()) is not None:
            if isinstance(event, BaseException):
                raise event
            yield event


class TasksCore:
    """What the engine tasks ask of the session core, recorded."""

    session_id = SID

    def __init__(self) -> None:
        self.lease_generation = 1
        self.results: list[tuple[Any, Fence | None]] = []
        self.failures: list[tuple[Any, BaseException]] = []
        self.engine_events: list[Any] = []

    def on_engine_event(self, event: Any, now_ms: float) -> list[Any]:
        self.engine_events.append(event)
        return [("event", event)]

    def on_result(self, cmd: Any, fence: Fence | None) -> None:
        self.results.append((cmd, fence))

    def on_failure(self, cmd: Any, exc: BaseException) -> list[Any]:
        self.failures.append((cmd, exc))
        return [("failure", type(exc).__name__)]

    def error(self, exc: BaseException) -> list[Any]:
        return [("error", type(exc).__name__)]


def test_engine_tasks_make_calls_in_order_and_end_with_the_engine_session(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made: list[Any] = []
    core = TasksCore()

    async def execute(engine: Any, core_: Any, cmd: Any) -> Fence | None:
        made.append(cmd)
        if isinstance(cmd, Touch) and len(made) == 1:
            core.lease_generation = 2  # resumed while the call was in flight
            raise ControlError("lease moved", code="stale_fence")
        if isinstance(cmd, CloseSession):
            raise ControlError("gone", code="not_found")  # logged only
        if isinstance(cmd, Cancel):
            raise ValueError("a bug")  # the client sees server_error
        return Fence(SID)

    monkeypatch.setattr(engine_tasks, "execute", execute)

    async def run() -> None:
        engine = EventsEngine()
        calls = CallQueue()
        applied: list[Any] = []

        def apply(actions: list[Any], *, t_in: float = 0.0) -> None:
            applied.extend(actions)

        tasks = EngineTasks(engine, core, calls, apply=apply, clock=lambda: 0.0)  # type: ignore[arg-type]
        runner = asyncio.create_task(tasks.run())
        touch = Touch(0, "detach")
        calls.put_nowait(touch)
        calls.put_nowait(CloseSession("client"))
        calls.put_nowait(Cancel(0, "response.cancel"))
        for _ in range(20):
            await asyncio.sleep(0)
        assert made[:2] == [touch, touch]  # made again under the new lease
        assert core.results == [(touch, Fence(SID))]
        assert [type(c) for c, _ in core.failures] == [Cancel]
        assert applied == [("failure", "ValueError")]
        await engine.events.put(None)  # the engine session ends: so does the caller
        await asyncio.wait_for(runner, 2)

    asyncio.run(run())


def test_a_dead_engine_is_reported_by_the_pump(monkeypatch: pytest.MonkeyPatch) -> None:
    async def run() -> None:
        engine = EventsEngine()
        applied: list[Any] = []

        def apply(actions: list[Any], *, t_in: float = 0.0) -> None:
            applied.extend(actions)

        tasks = EngineTasks(
            engine,  # type: ignore[arg-type]
            TasksCore(),  # type: ignore[arg-type]
            CallQueue(),
            apply=apply,
            clock=lambda: 0.0,
        )
        await engine.events.put(EngineDeadError("gone"))
        await asyncio.wait_for(tasks.run(), 2)
        assert applied == [("error", "EngineDeadError")]

    asyncio.run(run())


# ---------------------------------------------------------------------------- adoption
class AdoptableEngine(FakeEngine):
    """A session another front end held: the engine has its replica."""

    def __init__(self, replica: bytes) -> None:
        super().__init__()
        self.replica = replica

    async def call(self, call: ControlCall) -> ControlResult:
        if not isinstance(call, ResumeCall):
            return await super().call(call)
        self.calls.append("peek" if call.peek else f"resume:{call.expected_lease_generation}")
        if call.peek:
            return ControlResult(
                control_id=1, ok=True, session_id=SID, lease_generation=3, replica=self.replica
            )
        fence = Fence(SID, 2, 5, 5)
        return ControlResult(
            control_id=1,
            ok=True,
            session_id=SID,
            lease_generation=4,
            accepted_fence=fence,
            input_seq=7,
        )


def _held(token_hash: bytes) -> SessionMachine:
    """The core of the session the other front end held (its replica is made of it)."""
    core = SessionMachine(SID, EffectiveSession())
    core.resumption.token_hash = token_hash
    return core


@pytest.mark.parametrize("handed_over", [False, True])
def test_the_registry_adopts_a_session_its_front_end_gave_up(handed_over: bool) -> None:
    token, digest = new_resume_token()
    blob = snapshot.encode(_held(digest), 40, handed_over=handed_over)

    async def main() -> None:
        engine = AdoptableEngine(blob)
        with ThreadPoolExecutor(1) as pool:
            sessions = await _sessions(engine, pool)
            t = FakeTransport()
            req = ev.SessionResume(
                session_id=SID, resume_token=token, last_received_server_event_seq=40
            )
            session = await sessions.adopt(t, req)
            t.session = session
            assert engine.calls == ["peek", "resume:3"]  # the compare and swap
            assert sessions.live[SID] is session and session.attachment is t
            assert session.core.lease_generation == 4 and session.core.epoch == 2
            types = t.flush()
            assert types[-1] == "session.resumed"
            assert ("session.resync_required" in types) is not handed_over
            assert _seqs([json.dumps(e).encode() for e in t.written])[0] == 41
            bad = ev.SessionResume(
                session_id=SID, resume_token="x", last_received_server_event_seq=0
            )
            with pytest.raises(SessionFatal) as refused:
                await sessions.adopt(FakeTransport(), bad)
            assert refused.value.code == "invalid_resume_token"
            await sessions.shutdown(1.0)

    asyncio.run(main())


def test_a_session_without_a_replica_cannot_be_adopted() -> None:
    async def main() -> None:
        with ThreadPoolExecutor(1) as pool:
            sessions = await _sessions(AdoptableEngine(b""), pool)
            req = ev.SessionResume(session_id=SID, resume_token="x")
            with pytest.raises(SessionFatal) as refused:
                await sessions.resume(FakeTransport(), req)
            assert refused.value.code == "session_not_found"

    asyncio.run(main())
