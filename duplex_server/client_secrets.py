"""Ephemeral client secrets: short-lived keys a browser may hold instead of an API key.

OpenAI's browser flow, same shape: the application's own server, holding a real API key,
mints a secret (``POST /v1/realtime/client_secrets``, duplex_server/http/secrets_route.py) and
hands its ``value`` to the page; the page opens one realtime session with it, as the
WebSocket subprotocol ``openai-insecure-api-key.<value>`` or ``Authorization: Bearer <value>``
on ``/v1/realtime`` (``/v1/duplex``), or as the Bearer key of WebRTC's
``POST /v1/realtime/calls``. The session starts with the session configuration the secret
was minted with (the client's own ``session.update`` can change it later).

A secret (``ek_<payload>.<signature>``, base64url) carries its id, its expiry and that
configuration, signed with HMAC-SHA256 under the server's secret key, so any front end that
holds the key checks it without asking anyone: the key is ``DUPLEX_CLIENT_SECRET_KEY`` when
set, else made at random when the process starts (``serve --workers`` makes one and hands it
to every front end it starts, so a secret minted on one front end opens a session on any).

Rules (:meth:`ClientSecrets.check`):

* expiry by time, as OpenAI's: ``expires_after.seconds`` 10-7200 (default 600) after minting;
* single use (our choice): a secret opens one session; a second open is refused
  (``client_secret_used``). A used secret still admits the *resume* of a dropped socket
  (``?intent=resume``: the session's resume token is what authenticates it), so the page's
  automatic reconnect works. The record of uses lives in the front end's memory until the
  secret expires: under ``serve --workers`` a secret is single use per front end;
* a secret opens realtime sessions only: the batch routes and minting refuse it
  (``client_secret_wrong_route``).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
from dataclasses import dataclass, field
from typing import Any, Literal

PREFIX = "ek_"
KEY_ENV = "DUPLEX_CLIENT_SECRET_KEY"
MIN_TTL_S, MAX_TTL_S, DEFAULT_TTL_S = 10, 7200, 600

Use = Literal["open", "resume"]


class SecretRefused(Exception):
    """A client secret that does not admit this use; ``code`` is the wire error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def is_secret(candidate: str) -> bool:
    return candidate.startswith(PREFIX)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@dataclass
class ClientSecrets:
    """Mints and checks the secrets of one server (its key, and the uses it has seen)."""

    key: bytes
    _used: dict[str, float] = field(default_factory=dict)  # secret id -> its expiry

    @classmethod
    def from_env(cls) -> ClientSecrets:
        """Keyed by ``DUPLEX_CLIENT_SECRET_KEY`` if set, else by a random key."""
        key = os.environ.get(KEY_ENV, "")
        return cls(key.encode() if key else secrets.token_bytes(32))

    def mint(self, session: dict[str, Any], ttl_s: int, now: float) -> tuple[str, int]:
        """A new secret for ``session`` (a session object) valid ``ttl_s`` seconds from
        ``now`` (Unix time); returns ``(value, expires_at)``."""
        if not MIN_TTL_S <= ttl_s <= MAX_TTL_S:
            raise ValueError(f"ttl_s must be {MIN_TTL_S}-{MAX_TTL_S}, got {ttl_s}")
        expires_at = int(now) + ttl_s
        payload = json.dumps(
            {"id": secrets.token_hex(12), "exp": expires_at, "session": session},
            separators=(",", ":"),
        ).encode()
        return f"{PREFIX}{_b64(payload)}.{_b64(self._sign(payload))}", expires_at

    def check(self, value: str, use: Use, now: float) -> dict[str, Any]:
        """The session object ``value`` was minted with, if it admits ``use`` at ``now``
        (an ``open`` records the use); raises :class:`SecretRefused`."""
        body = value[len(PREFIX) :] if is_secret(value) else ""
        payload_b64, _, sig_b64 = body.partition(".")
        try:
            payload, sig = _unb64(payload_b64), _unb64(sig_b64)
            valid = bool(payload) and hmac.compare_digest(sig, self._sign(payload))
            claims = json.loads(payload) if valid else None
        except (ValueError, json.JSONDecodeError):
            valid, claims = False, None
        if not valid or not isinstance(claims, dict):
            raise SecretRefused("invalid_client_secret", "the client secret is not valid here")
        if use == "resume":
            return dict(claims["session"])  # the resume token authenticates the session
        if now >= claims["exp"]:
            raise SecretRefused(
                "client_secret_expired", "the client secret has expired; mint a new one"
            )
        self._forget_expired(now)
        if claims["id"] in self._used:
            raise SecretRefused(
                "client_secret_used", "the client secret has opened a session already"
            )
        self._used[claims["id"]] = float(claims["exp"])
        return dict(claims["session"])

    def _sign(self, payload: bytes) -> bytes:
        return hmac.new(self.key, payload, hashlib.sha256).digest()

    def _forget_expired(self, now: float) -> None:
        for sid in [s for s, exp in self._used.items() if exp <= now]:
            del self._used[sid]
