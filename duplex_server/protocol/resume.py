"""Resume tokens (pure): a 256-bit one-time token; the server keeps only its digest."""

from __future__ import annotations

import hashlib
import hmac
import secrets


def new_resume_token() -> tuple[str, bytes]:
    """A 256-bit one-time token and the SHA-256 digest the server keeps instead of it."""
    token = secrets.token_urlsafe(32)
    return token, hashlib.sha256(token.encode()).digest()


def token_matches(token: str, digest: bytes) -> bool:
    return hmac.compare_digest(hashlib.sha256(token.encode()).digest(), digest)
