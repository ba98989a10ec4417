"""Admission for every route: API keys (Bearer header or browser subprotocol), Origin allow-list.

One check, :func:`admit`, decides for HTTP and WebSocket alike:

* WebSocket endpoints (``/v1/realtime``, ``/v1/duplex``, ``/v1/twilio``) call it in their
  handshake and refuse with an ``error`` event and close code 1008.
* :class:`HttpAuth`, an ASGI middleware in front of the app, calls it for every HTTP request
  under ``/v1/`` (the batch routes, ``/v1/models``, WebRTC's ``/v1/realtime/calls``) and for
  ``/metrics`` unless ``server.metrics_access`` is ``open``. A refusal is OpenAI's shape::

      401 {"error": {"message", "type": "invalid_request_error", "param": null,
                     "code": "invalid_api_key"}}        (missing or wrong key)
      403 {"error": {..., "code": "origin_not_allowed"}} (Origin not in the allow-list)

``/health`` and the browser page at ``/`` stay open. With no keys configured every route is
open (the Origin allow-list still applies).

An ephemeral client secret (``ek_...``, duplex_server/client_secrets.py) stands in for a key
where a realtime session opens: the WebSocket handshake of ``/v1/realtime`` and ``/v1/duplex``
(``secret_use``: ``open``, or ``resume`` on a ``?intent=resume`` socket) and WebRTC's
``POST /v1/realtime/calls``; the decision then carries the session object it was minted with.
Anywhere else it is refused (401 ``client_secret_wrong_route``), and a secret that is
expired, used or forged is refused even where no keys are configured.
"""

from __future__ import annotations

import hmac
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from duplex_server.client_secrets import ClientSecrets, SecretRefused, Use, is_secret

KEY_PROTOCOL_PREFIX = "openai-insecure-api-key."
#: the request state key under which HttpAuth leaves a client secret's session object
SECRET_SESSION = "client_secret_session"
ECHO_PROTOCOLS = ("realtime",)


@dataclass(frozen=True, slots=True)
class AccessDecision:
    """What :func:`admit` decided: may the request proceed (else the refusal's ``code`` and
    ``message``), and which WebSocket subprotocol to echo."""

    ok: bool
    subprotocol: str | None
    code: str = ""
    message: str = ""
    #: admitted by a client secret: the session object it was minted with
    session: dict[str, Any] | None = None


def key_matches(candidate: str, keys: frozenset[str]) -> bool:
    """Is ``candidate`` one of ``keys`` (constant time per key)? No keys: anything is."""
    return not keys or _matches(candidate, keys)


def _matches(candidate: str, keys: frozenset[str]) -> bool:
    found = False
    for key in keys:  # constant time per key; no early exit
        found |= hmac.compare_digest(candidate.encode(), key.encode())
    return found


def admit(
    headers: Mapping[str, str],
    subprotocols: Sequence[str],
    *,
    keys: frozenset[str],
    allowed_origins: list[str] | None,
    secrets: ClientSecrets | None = None,
    secret_use: Use | None = None,
    now: float = 0.0,
) -> AccessDecision:
    """Decide whether a WebSocket handshake (or an HTTP request) may proceed, and which
    subprotocol to echo. ``secret_use``: what a client secret may do here (None: it is
    refused); ``now``: Unix time, for its expiry."""
    echo = next((p for p in subprotocols if p in ECHO_PROTOCOLS), None)
    if echo is None:
        echo = next((p for p in subprotocols if p.startswith(KEY_PROTOCOL_PREFIX)), None)
    origin = headers.get("origin")
    if allowed_origins is not None and origin is not None and origin not in allowed_origins:
        return AccessDecision(False, echo, "origin_not_allowed", f"origin {origin} is not allowed")
    candidates: list[str] = []
    authz = headers.get("authorization", "")
    if authz.lower().startswith("bearer "):
        candidates.append(authz[7:].strip())
    candidates += [
        p[len(KEY_PROTOCOL_PREFIX) :] for p in subprotocols if p.startswith(KEY_PROTOCOL_PREFIX)
    ]
    secret = next((c for c in candidates if is_secret(c)), None)
    if secret is not None:
        if secrets is None or secret_use is None:
            return AccessDecision(
                False,
                echo,
                "client_secret_wrong_route",
                "a client secret opens a realtime session only (WebSocket /v1/realtime or "
                "WebRTC /v1/realtime/calls); use an API key here",
            )
        try:
            session = secrets.check(secret, secret_use, now)
        except SecretRefused as exc:
            return AccessDecision(False, echo, exc.code, exc.message)
        return AccessDecision(True, echo, session=session)
    if not keys:
        return AccessDecision(True, echo)
    if any(_matches(c, keys) for c in candidates):
        return AccessDecision(True, echo)
    return AccessDecision(False, echo, "unauthorized", "missing or invalid API key")


MetricsAccess = Literal["keyed", "open"]


def guards_http_path(path: str, metrics_access: MetricsAccess) -> bool:
    """Does an HTTP request for ``path`` need a key (when keys are configured)?"""
    if path.startswith("/v1/") or path == "/v1":
        return True
    return path == "/metrics" and metrics_access == "keyed"


#: the HTTP route where a client secret opens a session (WebRTC's call set-up)
SECRET_HTTP_PATHS = frozenset({"/v1/realtime/calls"})


def http_refusal(adm: AccessDecision) -> tuple[int, bytes]:
    """The status and OpenAI-shaped JSON body of a refused HTTP request."""
    if adm.code != "origin_not_allowed" and adm.code != "unauthorized":
        status, code, message = 401, adm.code, adm.message  # a client secret refused
    elif adm.code == "unauthorized":
        status, code = 401, "invalid_api_key"
        message = (
            "Missing or invalid API key: send it as 'Authorization: Bearer <key>' "
            "(the server's keys are set by server.api_keys or DUPLEX_API_KEYS)"
        )
    else:
        status, code, message = 403, adm.code, adm.message
    body = {
        "error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}
    }
    return status, json.dumps(body).encode()


class HttpAuth:
    """ASGI middleware: :func:`admit` for every guarded HTTP request (WebSockets pass through
    to their endpoints, which run the same check in their handshake)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        keys: frozenset[str],
        allowed_origins: list[str] | None,
        metrics_access: MetricsAccess,
        secrets: ClientSecrets | None = None,
    ) -> None:
        self.app, self.keys, self.allowed_origins = app, keys, allowed_origins
        self.metrics_access = metrics_access
        self.secrets = secrets

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not guards_http_path(scope["path"], self.metrics_access):
            await self.app(scope, receive, send)
            return
        opens = scope["path"] in SECRET_HTTP_PATHS and scope["method"] == "POST"
        adm = admit(
            Headers(scope=scope),
            [],
            keys=self.keys,
            allowed_origins=self.allowed_origins,
            secrets=self.secrets,
            secret_use="open" if opens else None,
            now=time.time(),
        )
        if adm.ok:
            if adm.session is not None:  # the route applies it (WebRTC: before the form's)
                scope.setdefault("state", {})[SECRET_SESSION] = adm.session
            await self.app(scope, receive, send)
            return
        status, body = http_refusal(adm)
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        if status == 401:
            headers.append((b"www-authenticate", b'Bearer realm="duplex-server"'))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
