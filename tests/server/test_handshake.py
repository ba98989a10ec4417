"""The one handshake (duplex_server/session/handshake.py) on a real hub: admission, the hub's books,
refusal while the engine cannot take a session, and the refusal's close code. (Opening and
resuming over each transport: test_errors_auth, tests/e2e/test_duplex, test_twilio*,
test_webrtc.)"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from duplex_contract.errors import EngineDeadError, EngineError
from duplex_server.protocol.errors import ProtocolError, SessionFatal
from duplex_server.session import handshake
from tests.server.test_writer import _hub


class Books:
    """A transport as the hub sees it."""

    send_since: float | None = None

    def send_stalled(self) -> None: ...

    def close(self, code: int, reason: str) -> None: ...

    @property
    def queued_bytes(self) -> int:
        return 0


def _sample(hub: Any, name: str, labels: dict[str, str]) -> float:
    value = hub.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else float(value)


def test_admission_checks_the_key_and_the_origin() -> None:
    with ThreadPoolExecutor(1) as pool:
        hub = _hub(pool, api_keys=["sk-1"], allowed_origins=["https://ok.example"])
        ok = handshake.admit_socket(hub, {"authorization": "Bearer sk-1"}, [])
        assert ok.ok
        bad = handshake.admit_socket(hub, {"authorization": "Bearer nope"}, [])
        assert (bad.ok, bad.code) == (False, "unauthorized")
        keyed = handshake.admit_socket(hub, {}, ["realtime", "openai-insecure-api-key.sk-1"])
        assert keyed.ok and keyed.subprotocol == "realtime"
        origin = handshake.admit_socket(
            hub, {"authorization": "Bearer sk-1", "origin": "https://evil.example"}, []
        )
        assert (origin.ok, origin.code) == (False, "origin_not_allowed")


def test_connected_and_disconnected_keep_the_hubs_books() -> None:
    async def run() -> None:
        with ThreadPoolExecutor(1) as pool:
            hub = _hub(pool)
            a, b = Books(), Books()
            handshake.connected(hub, a)
            handshake.connected(hub, b)
            assert hub.sockets == {a, b}
            assert _sample(hub, "duplex_connections", {"state": "open"}) == 2
            hub.no_connections.clear()
            handshake.disconnected(hub, a)
            assert not hub.no_connections.is_set()
            handshake.disconnected(hub, b)
            assert hub.no_connections.is_set() and not hub.sockets
            assert _sample(hub, "duplex_connections", {"state": "open"}) == 0
            handshake.outcome(hub, "opened")
            assert _sample(hub, "duplex_connection_outcomes_total", {"outcome": "opened"}) == 1

    asyncio.run(run())


def test_no_session_while_the_engine_is_missing_or_the_server_closes() -> None:
    async def run() -> None:
        with ThreadPoolExecutor(1) as pool:
            hub = _hub(pool)
            assert hub.sessions.engine is None
            for call in (
                handshake.open_session(hub, Books(), beta=False),  # type: ignore[arg-type]
                handshake.resume_session(hub, Books(), None),  # type: ignore[arg-type]
            ):
                with pytest.raises(SessionFatal) as info:
                    await call
                assert info.value.code == "engine_unavailable"
                assert handshake.refusal(info.value)[1] == 1013  # try again later
            hub.closing = True
            with pytest.raises(SessionFatal, match="not ready"):
                handshake.require_engine(hub)

    asyncio.run(run())


def test_a_refusal_closes_with_its_own_code_or_1008() -> None:
    detail, close = handshake.refusal(ProtocolError("unauthorized", "missing or invalid API key"))
    assert (detail.code, close) == ("unauthorized", 1008)
    detail, close = handshake.refusal(SessionFatal("session_not_found", "gone", close_code=4000))
    assert (detail.code, close) == ("session_not_found", 4000)
    # an engine error that names no close code (a failed open) closes with 1008 too
    detail, close = handshake.refusal(EngineError("the open failed"))
    assert (detail.code, detail.type, close) == ("internal_error", "server_error", 1008)
    # one that does (the engine is gone): its own
    detail, close = handshake.refusal(EngineDeadError("gone"))
    assert (detail.code, close) == ("engine_unavailable", 1011)
