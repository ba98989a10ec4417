"""Twilio request signing for the ``/v1/twilio`` WebSocket upgrade (``X-Twilio-Signature``).

Twilio signs each request it makes with the account's auth token: the base64 HMAC-SHA1 of
the full URL it requested (for a form POST, followed by each POST parameter's name and value,
sorted by name; the Media Streams upgrade is a GET, so the URL alone), keyed by the auth
token. For a ``<Connect><Stream url="wss://...">`` the URL is the ``wss://`` URL of the
TwiML. Its helper libraries accept the signature computed over the URL with or without the
scheme's default port (``:443``); so does :func:`verify`.

Which URL: ``server.twilio.public_url`` when set (the stream URL exactly as the TwiML names
it, for a server behind a proxy that rewrites the host), else the URL rebuilt from the
request (its ``Host`` header, path and query) with the scheme ``wss`` (what Twilio
connects with) or the one this server saw (a TLS-terminating proxy in front makes it
``ws``). docs/protocol.md §12.2.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Mapping
from typing import Literal
from urllib.parse import urlsplit, urlunsplit

Verdict = Literal["signed", "missing", "invalid"]
_DEFAULT_PORT = {"wss": 443, "https": 443, "ws": 80, "http": 80}


def signature(auth_token: str, url: str, params: Mapping[str, str] | None = None) -> str:
    """Twilio's signature of a request to ``url`` (``params``: a form POST's parameters)."""
    data = url + "".join(k + v for k, v in sorted((params or {}).items()))
    digest = hmac.new(auth_token.encode(), data.encode(), hashlib.sha1).digest()
    return base64.b64encode(digest).decode()


def port_variants(url: str) -> list[str]:
    """``url`` as given, and with its scheme's default port added or removed."""
    parts = urlsplit(url)
    default = _DEFAULT_PORT.get(parts.scheme)
    host = parts.hostname or ""
    if default is None or not host:
        return [url]
    if ":" in host:  # an IPv6 literal
        host = f"[{host}]"
    if parts.port is None:
        other = parts._replace(netloc=f"{host}:{default}")
    elif parts.port == default:
        other = parts._replace(netloc=host)
    else:
        return [url]
    return [url, urlunsplit(other)]


def candidate_urls(
    public_url: str | None, *, scheme: str, host: str, path: str, query: str
) -> list[str]:
    """The URLs Twilio may have signed for this request."""
    if public_url is not None:
        bases = [public_url + (f"?{query}" if query and "?" not in public_url else "")]
    else:
        tail = path + (f"?{query}" if query else "")
        bases = [f"{s}://{host}{tail}" for s in dict.fromkeys(("wss", scheme))]
    return [v for b in bases for v in port_variants(b)]


def verify(auth_token: str, header: str | None, urls: list[str]) -> Verdict:
    """Does ``header`` (the ``X-Twilio-Signature`` value) sign one of ``urls``?"""
    if not header:
        return "missing"
    found = False
    for url in urls:  # constant time per URL; no early exit
        found |= hmac.compare_digest(signature(auth_token, url).encode(), header.strip().encode())
    return "signed" if found else "invalid"
