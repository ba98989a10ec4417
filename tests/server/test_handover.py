"""A drain's handover of one session (duplex_server/ops/drain.py), without sockets: the
replica the taker reads says "handed over at the seq of session.handover" whenever the
client was sent nothing after it, so the taker says no ``session.resync_required``."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

from duplex_server.ops.drain import hand_over
from duplex_server.protocol.session_config import EffectiveSession
from duplex_server.session import snapshot
from tests.server.test_runtime import FakeEngine, FakeTransport, _caps, _sessions, _settle


def test_a_heartbeat_read_after_the_handover_is_not_acknowledged() -> None:
    """A heartbeat the client sent before it read the handover, read by the server after
    it: an ack stamped then made the replica "not handed over", and the taker said resync
    (bench/failover.py --kill drain: 1 session in ~100)."""

    async def main() -> None:
        engine = FakeEngine()
        with ThreadPoolExecutor(1) as pool:
            sessions = await _sessions(engine, pool)
            t = FakeTransport()
            session = await sessions.open(t, _caps(), beta=False)
            t.session = session
            assert t.flush() == ["session.created"]
            session.receive_text(json.dumps({"type": "session.heartbeat"}))
            assert t.flush()[-1] == "session.heartbeat_ack"  # before the handover: acked
            await hand_over(session)
            session.receive_text(json.dumps({"type": "session.heartbeat"}))
            await _settle()
            types = t.flush()
            assert types[-1] == "session.handover", types  # nothing after it
            assert t.closed is not None and t.closed[0] == 1012
            rep = snapshot.decode(engine.replicas[-1], EffectiveSession())
            assert rep.handed_over and rep.event_seq == t.written[-1]["server_event_seq"]
            seqs = [e["server_event_seq"] for e in t.written]
            assert seqs == sorted(set(seqs)), seqs  # written in order, the handover last

    asyncio.run(main())


class _BeatDuringReplica(FakeEngine):
    """An engine during whose first handed-over replica write the client's heartbeat is
    read (an event stamped meanwhile, ahead of the handover)."""

    def __init__(self) -> None:
        super().__init__()
        self.session: object | None = None
        self.beaten = False

    async def call(self, call: object) -> object:  # type: ignore[override]
        from duplex_contract.control import ReplicaCall
        from duplex_server.session.live import LiveSession

        if isinstance(call, ReplicaCall) and not self.beaten and self.session is not None:
            rep = snapshot.decode(call.state, EffectiveSession())
            if rep.handed_over:
                self.beaten = True
                assert isinstance(self.session, LiveSession)
                self.session.receive_text(json.dumps({"type": "session.heartbeat"}))
                await asyncio.sleep(0)
        return await super().call(call)  # type: ignore[arg-type]


def test_an_event_while_the_replica_is_written_goes_first_and_the_handover_stays_clean() -> None:
    """An event stamped while the handed-over replica is on its way to the engine goes to
    the client before the handover, and the replica is written again after it: still
    handed over, at the handover's seq (it said resync before)."""

    async def main() -> None:
        engine = _BeatDuringReplica()
        with ThreadPoolExecutor(1) as pool:
            sessions = await _sessions(engine, pool)
            t = FakeTransport()
            session = await sessions.open(t, _caps(), beta=False)
            t.session = session
            engine.session = session
            t.flush()

            async def writer() -> None:  # as a socket's writer: what is queued is written
                while True:
                    t.flush()
                    await asyncio.sleep(0.005)

            writing = asyncio.create_task(writer())
            await hand_over(session)
            await _settle()
            writing.cancel()
            types = t.flush()
            assert engine.beaten
            assert types[-2:] == ["session.heartbeat_ack", "session.handover"], types
            rep = snapshot.decode(engine.replicas[-1], EffectiveSession())
            assert rep.handed_over and rep.event_seq == t.written[-1]["server_event_seq"]
            seqs = [e["server_event_seq"] for e in t.written]
            assert seqs == sorted(set(seqs)), seqs  # written in order, the handover last

    asyncio.run(main())
