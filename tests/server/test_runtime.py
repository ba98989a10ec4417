"""The session runtime with no socket: a fake transport (the Attachment interface) and a
fake engine (the EngineSessions API: one ``call``). Any transport that implements the interface gets
the same session: this is what a WebRTC or telephony transport plugs into."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from duplex_contract.control import (
    AppendCall,
    CloseCall,
    CommitCall,
    ControlCall,
    ControlResult,
    OpenCall,
    ReplicaCall,
    ResumeCall,
    SignalCall,
    TouchCall,
)
from duplex_contract.fence import Fence
from duplex_contract.session_events import (
    AudioChunk,
    ResponseDone,
    ResponseStarted,
    SessionEvent,
    TextDelta,
)
from duplex_contract.settings import SessionSettings, SessionUpdate
from duplex_server.ops.metrics import Metrics
from duplex_server.protocol import events as ev
from duplex_server.protocol.errors import SessionFatal
from duplex_server.session.attach import Outgoing
from duplex_server.session.input_lane import InputScheduler
from duplex_server.session.live import LiveSession, SessionLimits
from duplex_server.session.output_audio import OutputEncoder
from duplex_server.session.registry import Sessions

SID = "sess_0123456789abcdef0123456789abcdef"


class FakeTransport:
    """An Attachment that writes by hand: ``flush`` stamps what is queued, in order."""

    def __init__(self, session: LiveSession | None = None, budget: int = 1 << 20) -> None:
        self.session = session
        self.queue: list[Outgoing] = []
        self.budget = budget
        self.written: list[dict[str, object]] = []
        self.closed: tuple[int, str] | None = None
        self.replaced_with: bytes | None = None

    def send_event(self, item: Outgoing) -> bool:
        if self.queued_bytes + item.size > self.budget and self.queue:
            return False
        self.queue.append(item)
        return True

    def send_stamped(self, data: bytes) -> None:
        self.queue.append(Outgoing(None, data, len(data)))

    def purge_audio(self, below_epoch: int) -> int:
        before = len(self.queue)
        self.queue = [i for i in self.queue if i.epoch is None or i.epoch >= below_epoch]
        return before - len(self.queue)

    def take_unsent(self) -> list[Outgoing]:
        out, self.queue = self.queue, []
        return out

    def close(self, code: int, reason: str) -> None:
        self.closed = self.closed or (code, reason)

    def replaced(self, data: bytes) -> None:
        self.queue = []
        self.replaced_with = data
        self.close(1000, "replaced")

    @property
    def queued_bytes(self) -> int:
        return sum(i.size for i in self.queue)

    def flush(self) -> list[str]:
        assert self.session is not None
        for item in self.take_unsent():
            data = self.session.next_frame(item)
            if data is not None:
                self.written.append(json.loads(data))
        return [str(e["type"]) for e in self.written]


class FakeEngine:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.replicas: list[bytes] = []
        self.events: asyncio.Queue[SessionEvent | None] = asyncio.Queue()
        self.turn = 0
        self.updates: list[SessionUpdate | None] = []
        self.opened_with: SessionSettings | None = None

    @property
    def ready(self) -> bool:
        return True

    def _res(self, fence: Fence | None = None) -> ControlResult:
        return ControlResult(
            control_id=1, ok=True, session_id=SID, accepted_fence=fence, lease_generation=1
        )

    async def call(self, call: ControlCall) -> ControlResult:
        """The one engine call (as the real engines: duplex_contract.control's calls)."""
        if isinstance(call, OpenCall):
            self.calls.append("open")
            self.opened_with = call.config
            self.route_key = call.route_key
            return self._res(Fence(SID))
        if isinstance(call, ResumeCall):
            self.calls.append("resume")
            return ControlResult(control_id=1, ok=True, session_id=SID, lease_generation=2)
        if isinstance(call, ReplicaCall):
            self.replicas.append(call.state)
            return self._res(call.fence)
        if isinstance(call, AppendCall):
            self.calls.append(f"append:{call.text}")
            return self._res(call.fence)
        if isinstance(call, CommitCall):
            self.calls.append("commit")
            self.turn += 1
            return self._res(Fence(SID, call.fence.epoch, self.turn, self.turn))
        if isinstance(call, SignalCall):
            self.calls.append(call.event)
            self.updates.append(call.update)
            return self._res(call.next_fence or call.fence)
        if isinstance(call, TouchCall):
            self.calls.append(call.activity)
            return self._res(call.fence)
        assert isinstance(call, CloseCall)
        self.calls.append("close")
        await self.events.put(None)
        return self._res()

    async def session_events(self, session_id: str) -> AsyncIterator[SessionEvent]:
        while (event := await self.events.get()) is not None:
            yield event


def _caps() -> ev.Capabilities:
    return ev.Capabilities(True, True, ["pcm16"], ["pcm16"], ["none"], "energy", 1, 1, 1.0)


async def _sessions(engine: FakeEngine, pool: ThreadPoolExecutor) -> Sessions:
    limits = SessionLimits(1 << 20, 60.0, 1 << 16, "energy")
    sessions = Sessions(
        limits,
        InputScheduler(pool, 1),
        Metrics(lambda: None),
        instructions="be brief",
        model="m",
        output_rate=22050,
    )
    sessions.engine = engine
    return sessions


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def test_a_text_turn_resume_and_takeover_without_sockets() -> None:
    async def main() -> None:
        engine = FakeEngine()
        with ThreadPoolExecutor(1) as pool:
            sessions = await _sessions(engine, pool)
            a = FakeTransport()
            session = await sessions.open(a, _caps(), beta=False)
            a.session = session
            assert a.flush() == ["session.created"]
            created = a.written[0]["session"]
            token = str(a.written[0]["resume_token"])
            assert isinstance(created, dict) and created["id"] == SID
            update = {"type": "session.update", "session": {"output_modalities": ["text"]}}
            session.receive_text(json.dumps(update))
            session.receive_text(
                json.dumps(
                    {
                        "type": "conversation.item.create",
                        "item": {
                            "type": "message",
                            "role": "user",
                            "content": [{"type": "input_text", "text": "hi"}],
                        },
                    }
                )
            )
            session.receive_text(json.dumps({"type": "response.create"}))
            await _settle()
            assert engine.calls == ["open", "session.update", "append:hi", "commit"]
            settings = engine.updates[0]
            assert settings is not None and settings.settings is not None
            assert settings.settings.output_modalities == ("text",)
            # the engine speaks at the configured rate, on open and after every update
            assert engine.opened_with == SessionSettings(
                instructions="be brief", output_sample_rate=22050
            )
            assert settings.settings.output_sample_rate == 22050
            fence = Fence(SID, 0, 1, 1)
            await engine.events.put(ResponseStarted(fence=fence))
            await engine.events.put(TextDelta(fence=fence, text="hello"))
            await _settle()
            seen = a.flush()
            assert seen[-1] == "response.output_text.delta"
            last_seq = int(str(a.written[-1]["server_event_seq"]))
            # more output while nobody reads; then a second transport takes over
            await engine.events.put(ResponseDone(fence=fence, status="completed"))
            await _settle()
            b = FakeTransport()
            req = ev.SessionResume(
                session_id=SID, resume_token=token, last_received_server_event_seq=last_seq
            )
            assert await sessions.resume(b, req) is session
            b.session = session
            assert a.closed == (1000, "replaced") and a.replaced_with is not None
            assert b"session.replaced" in a.replaced_with
            resumed = b.flush()
            # what a never wrote is replayed to b, in order, then session.resumed
            assert "response.done" in resumed and resumed[-1] == "session.resumed"
            seqs = [int(str(e["server_event_seq"])) for e in b.written]
            assert seqs == list(range(last_seq + 1, last_seq + 1 + len(seqs)))
            try:
                await sessions.resume(FakeTransport(), req)  # the old token is spent
            except SessionFatal as exc:
                assert exc.code == "invalid_resume_token"
            else:
                raise AssertionError("a spent token resumed")
            session.receive_text(json.dumps({"type": "session.close"}))
            await _settle()
            assert b.closed == (1000, "client") and "close" in engine.calls
            await sessions.shutdown(1.0)
            assert len(sessions) == 0

    asyncio.run(main())


def test_a_transport_over_budget_ends_the_session_as_too_slow() -> None:
    async def main() -> None:
        engine = FakeEngine()
        with ThreadPoolExecutor(1) as pool:
            sessions = await _sessions(engine, pool)
            slow = FakeTransport(budget=600)
            session = await sessions.open(slow, _caps(), beta=False)
            slow.session = session
            for _ in range(3):  # never flushed: the queue fills
                session.receive_text(json.dumps({"type": "session.heartbeat"}))
            await _settle()
            types = slow.flush()
            assert types == ["error", "session.closed"]
            error = slow.written[0]["error"]
            assert isinstance(error, dict) and error["code"] == "client_too_slow"
            assert slow.closed == (1008, "client_too_slow")
            assert session.attachment is None  # released: later events are only journaled
            assert "close" in engine.calls
            await sessions.shutdown(1.0)

    asyncio.run(main())


def test_reply_audio_is_encoded_once_into_the_delta_with_its_pcm_beside_it() -> None:
    """The core hands the runtime PCM (``SendAudio``); the client's event is the same
    ``response.output_audio.delta`` as ever (base64 of the output format, stamped in turn)
    and a media transport gets the PCM without decoding it."""

    async def main() -> None:
        engine = FakeEngine()
        with ThreadPoolExecutor(1) as pool:
            sessions = await _sessions(engine, pool)
            a = FakeTransport()
            session = await sessions.open(a, _caps(), beta=False)
            a.session = session
            pcmu = {"audio": {"output": {"format": {"type": "audio/pcmu"}}}}
            session.receive_text(json.dumps({"type": "session.update", "session": pcmu}))
            session.receive_text(json.dumps({"type": "response.create"}))
            await _settle()
            fence = Fence(SID, 0, 1, 1)
            pcm = bytes(range(256)) * 40  # 10240 bytes: ~232 ms at 22050 Hz
            await engine.events.put(ResponseStarted(fence=fence))
            await engine.events.put(AudioChunk(fence, pcm, 22050, 0.0, 232.2, text="Hi"))
            await _settle()
            (audio,) = [i for i in a.queue if isinstance(i.event, ev.AudioDelta)]
            delta = audio.event
            assert isinstance(delta, ev.AudioDelta)
            fmt = session.core.config.output_format
            played, data = OutputEncoder().encode(pcm, 22050, fmt)
            assert fmt.codec == "g711_ulaw" and data and len(played) == 2 * len(data)
            assert base64.b64decode(delta.delta) == data and audio.pcm == played
            assert audio.epoch == delta.epoch == 0  # (the writer's and the purge's check)
            assert (delta.audio_start_ms, delta.duration_ms) == (0.0, 232.2)
            types = a.flush()
            at = types.index("response.output_audio.delta")
            assert types[at + 1] == "response.output_audio_transcript.delta"
            assert a.written[at]["delta"] == delta.delta
            assert a.written[at]["server_event_seq"] == at + 1
            await sessions.shutdown(1.0)

    asyncio.run(main())


class LosingEngine(FakeEngine):
    """Its close ends the event stream and then swallows the cancellation that follows, as
    Python 3.11's ``asyncio.wait_for`` did when the result arrived together with it."""

    async def call(self, call: ControlCall) -> ControlResult:
        if not isinstance(call, CloseCall):
            return await super().call(call)
        self.calls.append("close")
        await self.events.put(None)
        try:
            await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            pass  # the cancellation is lost
        return self._res()


def test_a_session_whose_engine_session_ended_leaves_even_if_a_cancellation_is_lost() -> None:
    async def main() -> None:
        engine = LosingEngine()
        with ThreadPoolExecutor(1) as pool:
            sessions = await _sessions(engine, pool)
            t = FakeTransport()
            session = await sessions.open(t, _caps(), beta=False)
            t.session = session
            session.receive_text(json.dumps({"type": "session.close"}))
            for _ in range(100):  # no shutdown: the session's tasks must end by themselves
                if len(sessions) == 0:
                    break
                await asyncio.sleep(0.01)
            assert len(sessions) == 0 and "close" in engine.calls
            assert sessions.by_state() == {"attached": 0, "detached": 0, "closing": 0}

    asyncio.run(main())
