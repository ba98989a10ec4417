"""One replica's connection to an OpenAI-compatible server, with duplex semantics.

Both remote backends hold one (engine/stages/openai_remote.py: llm, asr, tts;
engine/stages/talker_remote.py: the talker); what a request sends and how its answer becomes
outputs is theirs (a ``call``), the rest is the :class:`OpenAIConnection`'s:

* the fenced stage request id travels as the ``X-Request-Id`` header (and, with
  ``request_id_field``, as the body's ``request_id``, which vLLM uses as its own id);
* a barge-in aborts by closing the stream (vLLM aborts a request whose client went away);
  nothing that arrives after the abort is emitted;
* connect errors (and 502/503/504 answers) are retried with exponential backoff while the
  request has produced nothing; a failure after output fails that request only
  (``stage_failed``: the turn ends with an error event, the session goes on);
* a circuit breaker (:class:`Breaker`) opens after ``breaker_failures`` consecutive
  failures: requests then fail at once (``stage_unavailable``) instead of hammering a dead
  server, ``health()`` names the stage, and after ``breaker_reset_s`` one request is let
  through to probe it;
* a stall longer than ``read_timeout_s`` between two pieces of a stream fails the request.

The HTTP client (httpx, one connection pool per replica) runs on the orchestrator's loop:
network waits only, no compute.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol

import httpx

from duplex_contract.errors import ConfigError, StageError
from engine.messages import StageDone, StageOutput, StageRequest

log = logging.getLogger(__name__)

_RETRY_STATUS = frozenset({502, 503, 504})
_CLOSED: Any = object()  # the request's task has finished

#: what a call hands each output to (or the request's own error: it fails that request only)
Emit = Callable[[StageOutput | StageError], None]
#: one request's exchange with the server: send it, ``emit`` its outputs (ending with
#: StageDone); a :class:`RemoteFailure` or an httpx error is the remote's failure
Call = Callable[[httpx.AsyncClient, StageRequest, Emit], Awaitable[None]]


class ConnectionOptions(Protocol):
    """The options a connection reads (both remote backends' options have them)."""

    @property
    def base_url(self) -> str: ...

    @property
    def api_key(self) -> str | None: ...

    @property
    def api_key_env(self) -> str | None: ...

    @property
    def connect_timeout_s(self) -> float: ...

    @property
    def read_timeout_s(self) -> float: ...

    @property
    def pool_size(self) -> int: ...

    @property
    def retries(self) -> int: ...

    @property
    def backoff_s(self) -> float: ...

    @property
    def breaker_failures(self) -> int: ...

    @property
    def breaker_reset_s(self) -> float: ...

    @property
    def extra_body(self) -> dict[str, Any]: ...

    @property
    def request_id_field(self) -> bool: ...


class Breaker:
    """Consecutive-failure circuit breaker (closed -> open -> half-open -> closed)."""

    def __init__(self, failures: int, reset_s: float) -> None:
        self.failures = failures
        self.reset_s = reset_s
        self.count = 0
        self.opened_at: float | None = None
        self.probing = False
        self.last_error = ""

    def check(self, where: str) -> None:
        if self.opened_at is None:
            return
        if time.monotonic() - self.opened_at < self.reset_s or self.probing:
            raise StageError(
                f"{where} is down ({self.last_error}); not retried for "
                f"{self.reset_s:.0f} s (circuit open)",
                code="stage_unavailable",
            )
        self.probing = True  # half-open: this request probes the server

    def success(self) -> None:
        self.count = 0
        self.opened_at = None
        self.probing = False

    def failure(self, error: str) -> None:
        self.last_error = error
        self.probing = False
        self.count += 1
        if self.count >= self.failures:
            if self.opened_at is None:
                log.error("remote stage circuit opened: %s", error)
            self.opened_at = time.monotonic()

    @property
    def down(self) -> str | None:
        return self.last_error if self.opened_at is not None else None


class RemoteFailure(Exception):
    """A failure of the remote (counted by the breaker); ``retry``: worth retrying while
    the request has output nothing (a connect error, a 502/503/504 answer)."""

    def __init__(self, message: str, *, retry: bool) -> None:
        super().__init__(message)
        self.retry = retry


async def check(resp: httpx.Response) -> None:
    """An HTTP error answer as a :class:`RemoteFailure` (502/503/504: retried)."""
    if resp.status_code >= 400:
        text = (await resp.aread())[:300].decode(errors="replace")
        raise RemoteFailure(
            f"HTTP {resp.status_code}: {text.strip()}",
            retry=resp.status_code in _RETRY_STATUS,
        )


class OpenAIConnection:
    """The HTTP pool, retries, circuit breaker and requests in flight of one remote replica
    (see the module docstring). ``what`` names it in errors and ``/health`` (``remote llm
    stage``: ``remote llm stage 'llm' at http://...``)."""

    def __init__(self, options: ConnectionOptions, *, stage: str, what: str) -> None:
        self.options = options
        self.base_url = options.base_url.rstrip("/")
        if not self.base_url.startswith(("http://", "https://")):
            raise ConfigError(
                f"engine.stages.{stage}.options.base_url: expected http(s)://..., "
                f"got {options.base_url!r}"
            )
        self.where = f"{what} {stage!r} at {self.base_url}"
        self.breaker = Breaker(options.breaker_failures, options.breaker_reset_s)
        self._client: httpx.AsyncClient | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._aborting: set[str] = set()
        self.aborted = 0  # requests closed by an abort (their streams cut)

    def health(self) -> str | None:
        """Why the remote is down (its circuit is open), or None."""
        down = self.breaker.down
        return f"{self.where}: {down}" if down is not None else None

    async def start(self) -> None:
        o = self.options
        timeout = httpx.Timeout(o.read_timeout_s, connect=o.connect_timeout_s)
        limits = httpx.Limits(max_connections=o.pool_size, max_keepalive_connections=o.pool_size)
        self._client = httpx.AsyncClient(timeout=timeout, limits=limits)

    async def close(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def abort(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            task = self._tasks.get(rid)
            if task is not None and not task.done():
                self._aborting.add(rid)  # nothing more of it is emitted, from now
                task.cancel()  # closes the HTTP stream: the server sees the client go
                self.aborted += 1

    # ------------------------------------------------------------------ one request
    async def submit(self, request: StageRequest, call: Call) -> AsyncIterator[StageOutput]:
        """Stream the outputs ``call`` emits for ``request`` (retried while it has emitted
        nothing; see the module docstring)."""
        rid = request.request_id
        out: asyncio.Queue[Any] = asyncio.Queue()
        task = asyncio.create_task(self._run(request, call, out), name=f"remote:{rid}")
        task.add_done_callback(lambda _t: out.put_nowait(_CLOSED))
        self._tasks[rid] = task
        try:
            while True:
                item = await out.get()
                if rid in self._aborting or (item is _CLOSED and task.cancelled()):
                    yield StageDone(request_id=rid, finish_reason="aborted")
                    return
                if item is None or item is _CLOSED:
                    if item is _CLOSED and (exc := task.exception()) is not None:
                        raise StageError(f"{self.where}: {exc!r}")
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            self._tasks.pop(rid, None)
            self._aborting.discard(rid)

    async def _run(self, request: StageRequest, call: Call, out: asyncio.Queue[Any]) -> None:
        try:
            self.breaker.check(self.where)
        except StageError as exc:
            out.put_nowait(exc)
            return
        delay = self.options.backoff_s
        produced = [False]

        def emit(item: StageOutput | StageError) -> None:
            produced[0] = True
            out.put_nowait(item)

        for attempt in range(self.options.retries + 1):
            try:
                await self._once(request, call, emit)
            except RemoteFailure as exc:
                self.breaker.failure(str(exc))
                if exc.retry and not produced[0] and attempt < self.options.retries:
                    if self.breaker.down is not None:
                        out.put_nowait(StageError(f"{self.where}: {exc}", code="stage_unavailable"))
                        return
                    log.info("%s: %s; retrying in %.2f s", self.where, exc, delay)
                    await asyncio.sleep(delay)
                    delay *= 2
                    continue
                code = "stage_unavailable" if not produced[0] and exc.retry else "stage_failed"
                out.put_nowait(StageError(f"{self.where}: {exc}", code=code))
                return
            self.breaker.success()
            out.put_nowait(None)
            return

    async def _once(self, request: StageRequest, call: Call, emit: Emit) -> None:
        client = self._client
        if client is None:
            raise StageError(f"{self.where}: not started")
        try:
            await call(client, request, emit)
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
            raise RemoteFailure(f"cannot connect: {exc!r}", retry=True) from None
        except httpx.ReadTimeout:
            raise RemoteFailure(
                f"no data for {self.options.read_timeout_s:.0f} s (read timeout)", retry=False
            ) from None
        except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
            raise RemoteFailure(f"the stream broke: {exc!r}", retry=False) from None

    # ------------------------------------------------------------------ what calls use
    def headers(self, rid: str) -> dict[str, str]:
        """The headers of request ``rid``: its fenced id, and the API key if any."""
        headers = {"X-Request-Id": rid}
        key = self.options.api_key
        if key is None and self.options.api_key_env:
            key = os.environ.get(self.options.api_key_env)
        if key:
            headers["Authorization"] = f"Bearer {key}"
        return headers

    def body(self, rid: str, body: dict[str, Any]) -> dict[str, Any]:
        """``body`` with ``extra_body`` merged in (and the fenced id, with ``request_id_field``)."""
        merged = {**body, **self.options.extra_body}
        if self.options.request_id_field:
            merged["request_id"] = rid
        return merged

    async def events(
        self, client: httpx.AsyncClient, path: str, body: dict[str, Any], rid: str
    ) -> AsyncGenerator[dict[str, Any], None]:
        """POST ``body`` to ``path``, streamed (server-sent events): each event's JSON up to
        the stream's ``[DONE]``. An error event, an event that is not JSON or a stream that
        ends before ``[DONE]`` is a failure. Close it (``aclosing``) so that leaving early
        closes the connection at once, which is how the remote learns of an abort."""
        url = f"{self.base_url}{path}"
        async with client.stream("POST", url, json=body, headers=self.headers(rid)) as resp:
            await check(resp)
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                try:
                    chunk = json.loads(data)
                except json.JSONDecodeError:
                    msg = f"not JSON in the event stream: {data[:80]!r}"
                    raise RemoteFailure(msg, retry=False) from None
                if "error" in chunk:
                    raise RemoteFailure(f"the server reported: {chunk['error']}", retry=False)
                yield chunk
        raise RemoteFailure("the event stream ended without [DONE] (truncated)", retry=False)
