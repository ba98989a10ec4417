"""engine/stages/openai_connection.py alone: the circuit breaker, and one connection's retries,
headers, bodies and aborts over a mock HTTP transport (the remote backends over a fake
server are tests/engine/test_openai_remote.py and test_talker_remote.py)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from duplex_contract.batch import TextOut
from duplex_contract.errors import ConfigError, StageError
from engine.messages import LlmRequest, StageDone, StageOutput, StageRequest
from engine.stages.openai_connection import Breaker, Emit, OpenAIConnection, check
from engine.stages.openai_remote import OpenAIOptions
from tests.engine.conftest import UNIT, run


def test_the_breaker_opens_after_consecutive_failures_and_probes_after_its_reset() -> None:
    breaker = Breaker(failures=2, reset_s=0.05)
    breaker.check("remote")
    breaker.failure("refused")
    breaker.check("remote")  # one failure: still closed
    breaker.failure("refused")
    assert breaker.down == "refused"
    with pytest.raises(StageError, match="circuit open") as info:
        breaker.check("remote")
    assert info.value.code == "stage_unavailable"
    time.sleep(0.06)
    breaker.check("remote")  # half-open: this request probes
    with pytest.raises(StageError):
        breaker.check("remote")  # ... and only this one
    breaker.success()
    assert breaker.down is None
    breaker.check("remote")


def test_a_base_url_that_is_not_http_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"^engine\.stages\.llm\.options\.base_url: expected"):
        OpenAIConnection(OpenAIOptions(base_url="ftp://x"), stage="llm", what="remote llm stage")


def _connection(handler: Any, **options: Any) -> OpenAIConnection:
    opts = OpenAIOptions(base_url="http://remote/v1/", backoff_s=0.01, **options)
    conn = OpenAIConnection(opts, stage="llm", what="remote llm stage")
    conn._client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return conn


async def _post(client: httpx.AsyncClient, request: StageRequest, emit: Emit) -> None:
    resp = await client.post("http://remote/v1/x", json={}, headers={})
    await check(resp)
    emit(TextOut(request_id=request.request_id, text=resp.text))
    emit(StageDone(request_id=request.request_id))


async def _drain(conn: OpenAIConnection, call: Any, rid: str = "r") -> list[StageOutput]:
    return [o async for o in conn.submit(LlmRequest(request_id=rid, messages=()), call)]


def test_a_failure_before_any_output_is_retried_then_the_request_goes_through() -> None:
    answers = iter([503, 502, 200])

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(next(answers), text="hi")

    async def main() -> None:
        conn = _connection(handler, retries=2, breaker_failures=5)
        try:
            assert await _drain(conn, _post) == [TextOut("r", "hi"), StageDone("r")]
            assert conn.breaker.count == 0 and conn.health() is None
        finally:
            await conn.close()

    run(main())


def test_a_remote_that_keeps_failing_fails_the_request_and_opens_the_circuit() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, text="overloaded")

    async def main() -> None:
        conn = _connection(handler, retries=1, breaker_failures=2)
        try:
            with pytest.raises(StageError) as info:
                await _drain(conn, _post)
            assert info.value.code == "stage_unavailable" and "HTTP 503" in str(info.value)
            assert (conn.health() or "").startswith(
                "remote llm stage 'llm' at http://remote/v1: HTTP 503"
            )
        finally:
            await conn.close()

    run(main())


def test_headers_and_bodies_carry_the_fenced_id_and_the_extras() -> None:
    conn = OpenAIConnection(
        OpenAIOptions(
            base_url="http://remote/v1",
            api_key="k",
            extra_body={"priority": 1},
            request_id_field=True,
        ),
        stage="llm",
        what="remote llm stage",
    )
    assert conn.headers("s/e0/llm") == {"X-Request-Id": "s/e0/llm", "Authorization": "Bearer k"}
    assert conn.body("s/e0/llm", {"a": 1}) == {"a": 1, "priority": 1, "request_id": "s/e0/llm"}


def test_an_abort_ends_the_stream_at_once_and_nothing_later_is_emitted() -> None:
    async def hang(client: httpx.AsyncClient, request: StageRequest, emit: Emit) -> None:
        emit(TextOut(request_id=request.request_id, text="first"))
        await asyncio.sleep(3600)
        emit(TextOut(request_id=request.request_id, text="never"))

    async def main() -> None:
        conn = _connection(lambda request: httpx.Response(200))
        try:
            got: list[StageOutput] = []

            async def consume() -> None:
                async for out in conn.submit(LlmRequest(request_id="r", messages=()), hang):
                    got.append(out)
                    if len(got) == 1:
                        await conn.abort(["r"])

            await asyncio.wait_for(consume(), 5 * UNIT)
            assert got == [TextOut("r", "first"), StageDone("r", finish_reason="aborted")]
            assert conn.aborted == 1
        finally:
            await conn.close()

    run(main())
