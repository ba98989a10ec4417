"""WebSocket admission: API keys (Bearer header or browser subprotocol) and Origin allow-list."""

from __future__ import annotations

import hmac
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

KEY_PROTOCOL_PREFIX = "openai-insecure-api-key."
ECHO_PROTOCOLS = ("realtime",)


@dataclass(frozen=True, slots=True)
class Admission:
    ok: bool
    subprotocol: str | None
    code: str = ""
    message: str = ""


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
) -> Admission:
    """Decide whether a WebSocket handshake may proceed, and which subprotocol to echo."""
    echo = next((p for p in subprotocols if p in ECHO_PROTOCOLS), None)
    if echo is None:
        echo = next((p for p in subprotocols if p.startswith(KEY_PROTOCOL_PREFIX)), None)
    origin = headers.get("origin")
    if allowed_origins is not None and origin is not None and origin not in allowed_origins:
        return Admission(False, echo, "origin_not_allowed", f"origin {origin} is not allowed")
    if not keys:
        return Admission(True, echo)
    candidates: list[str] = []
    authz = headers.get("authorization", "")
    if authz.lower().startswith("bearer "):
        candidates.append(authz[7:].strip())
    candidates += [
        p[len(KEY_PROTOCOL_PREFIX) :] for p in subprotocols if p.startswith(KEY_PROTOCOL_PREFIX)
    ]
    if any(_matches(c, keys) for c in candidates):
        return Admission(True, echo)
    return Admission(False, echo, "unauthorized", "missing or invalid API key")
