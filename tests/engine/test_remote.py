"""The engine socket itself: addresses, handshake, bad frames, several front ends, and a
front end that goes away (the orchestrator behaviour over it is the parametrized suite)."""

from __future__ import annotations

import asyncio
import shutil
import struct
import tempfile

import pytest

from duplex_contract.control import AppendCall, CommitCall, OpenCall
from duplex_contract.errors import ConfigError, EngineDeadError
from duplex_contract.session_events import ResponseDone
from duplex_contract.settings import SessionSettings
from engine.api.remote import Address, EngineServer, parse_address
from engine.api.remote_client import RemoteEngine
from engine.api.remote_wire import Hello, Refused, frame, read_frame
from tests.engine.conftest import collect, make_config, run, stages


def test_addresses() -> None:
    assert parse_address("unix:///run/e.sock") == Address("unix", path="/run/e.sock")
    assert parse_address("/run/e.sock") == Address("unix", path="/run/e.sock")
    assert parse_address("tcp://10.0.0.5:7001") == Address("tcp", host="10.0.0.5", port=7001)
    assert parse_address("localhost:7001") == Address("tcp", host="localhost", port=7001)
    for bad in ("unix://", "tcp://host", "nonsense"):
        with pytest.raises(
            ConfigError, match=r"expected unix:///path or tcp://host:port|needs a path"
        ):
            parse_address(bad)


async def _server() -> tuple[EngineServer, str, str]:
    tmp = tempfile.mkdtemp(prefix="dx-")
    server = EngineServer(make_config(), stages(), stats_interval_s=0.05)
    await server.start("tcp://127.0.0.1:0")
    return server, str(server.address), tmp


async def _text_turn(engine: RemoteEngine) -> ResponseDone:
    res = await engine.call(OpenCall(config=SessionSettings(output_modalities=("text",))))
    assert res.session_id and res.accepted_fence
    await engine.call(AppendCall(fence=res.accepted_fence, lease_generation=1, text="hi"))
    await engine.call(CommitCall(fence=res.accepted_fence, lease_generation=1))
    events = await collect(engine, res.session_id, lambda e: isinstance(e, ResponseDone))
    done = events[-1]
    assert isinstance(done, ResponseDone)
    return done


def test_bad_peers_are_refused_and_harm_nobody() -> None:
    async def main() -> None:
        server, addr, tmp = await _server()
        good = await RemoteEngine.connect(addr, name="good")
        try:
            a = parse_address(addr)
            # a wrong protocol version is refused with a reason
            r, w = await asyncio.open_connection(a.host, a.port)
            w.write(frame(Hello(protocol=999)))
            body = await read_frame(r)
            assert body is not None and b"refused" in body
            w.close()
            await w.wait_closed()
            # garbage, an oversize frame header, and a peer that says nothing
            for junk in (b"\x00\x00\x00\x05hello", struct.pack(">I", 1 << 31)):
                r, w = await asyncio.open_connection(a.host, a.port)
                w.write(frame(Hello(protocol=1)) + junk)
                assert await asyncio.wait_for(r.read(), 5) is not None  # closed by the server
                w.close()
                await w.wait_closed()
            # the good front end still works, and its figures arrive
            done = await _text_turn(good)
            assert done.status == "completed"
            await asyncio.sleep(0.1)
            assert good.stats().sessions["open"] == 1
            assert server.front_ends == 1
        finally:
            await good.shutdown()
            await server.stop()
            shutil.rmtree(tmp, ignore_errors=True)
        with pytest.raises(EngineDeadError, match="cannot reach the engine"):
            await RemoteEngine.connect(addr, name="late", timeout_s=0.5)

    run(main())


def test_two_front_ends_each_get_their_own_sessions_and_a_gone_one_is_detached() -> None:
    async def main() -> None:
        server, addr, tmp = await _server()
        one = await RemoteEngine.connect(addr, name="one")
        two = await RemoteEngine.connect(addr, name="two")
        try:
            d1, d2 = await asyncio.gather(_text_turn(one), _text_turn(two))
            assert d1.fence.session_id != d2.fence.session_id
            assert d1.status == d2.status == "completed"
            assert server.front_ends == 2
            await one.shutdown()  # goes away with its session open
            for _ in range(100):
                await asyncio.sleep(0.02)
                if two.stats().sessions.get("detached") == 1:
                    break
            assert two.stats().sessions == {"open": 1, "detached": 1, "closing": 0}
            with pytest.raises(EngineDeadError):
                await one.call(OpenCall())  # a shut-down front end refuses calls
        finally:
            await two.shutdown()
            await server.stop()
            shutil.rmtree(tmp, ignore_errors=True)

    run(main())


def test_refused_message_type_is_a_real_struct() -> None:
    assert Refused(message="x").message == "x"


def test_session_ids_carry_the_front_ends_route_key() -> None:
    from duplex_contract.errors import ControlError
    from engine.duplex.fencing import new_session_id, route_key_of
    from tests.engine.conftest import start_engine

    assert route_key_of(new_session_id("w2")) == "w2"
    assert route_key_of(new_session_id()) is None
    assert route_key_of("sess_Evil!_x") is None

    async def main() -> None:
        engine = await start_engine()
        try:
            res = await engine.call(OpenCall(route_key="w7"))
            assert res.session_id is not None and res.session_id.startswith("sess_w7_")
            with pytest.raises(ControlError) as info:
                await engine.call(OpenCall(route_key="W7/../x"))
            assert info.value.code == "invalid_argument"
        finally:
            await engine.shutdown()

    run(main())
