"""``POST /v1/realtime/client_secrets``: mint an ephemeral client secret (OpenAI's shape).

The application's server calls it with a real API key (a client secret is refused here:
duplex_server/auth.py) and hands the ``value`` to a browser, which opens one realtime session
with it (duplex_server/client_secrets.py: the rules)::

    POST /v1/realtime/client_secrets
    {"expires_after": {"anchor": "created_at", "seconds": 600},     (10-7200; default 600)
     "session": {"type": "realtime", "instructions": "Be brief.", ...}}   (a session object)

    200 {"value": "ek_...", "expires_at": 1767000000,
         "session": {"type": "realtime", "object": "realtime.session", "model": "duplex",
                     "instructions": "Be brief.", ...}}

The session object is checked as a ``session.update`` would be (a bad field is a 400 naming
it); the session opened with the secret starts with it. Errors are OpenAI-shaped.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from duplex_server.client_secrets import DEFAULT_TTL_S, MAX_TTL_S, MIN_TTL_S, ClientSecrets
from duplex_server.http.batch_api import ApiError, error_response, read_json
from duplex_server.protocol import events as ev
from duplex_server.protocol.errors import ProtocolError
from duplex_server.protocol.session_config import EffectiveSession, apply_patch

MAX_BODY = 256 * 1024


class ExpiresAfter(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    anchor: Literal["created_at"] = "created_at"
    seconds: Annotated[int, msgspec.Meta(ge=MIN_TTL_S, le=MAX_TTL_S)] = DEFAULT_TTL_S


class SecretRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    expires_after: ExpiresAfter = ExpiresAfter()
    session: dict[str, Any] = {}


def check_session(session: dict[str, Any]) -> None:
    """Refuse a session object a ``session.update`` would refuse (400 naming the field)."""
    try:
        apply_patch(EffectiveSession(), msgspec.convert(session, ev.SessionParam))
    except msgspec.ValidationError as exc:
        raise ApiError(400, f"session: {exc}", param="session", code="invalid_value") from None
    except ProtocolError as exc:
        param = f"session.{exc.param}" if exc.param else "session"
        raise ApiError(400, exc.message, param=param, code=exc.code) from None


def routes(secrets: ClientSecrets, model_name: str) -> list[BaseRoute]:
    async def mint(request: Request) -> Response:
        try:
            body = await read_json(request, SecretRequest, MAX_BODY)
            check_session(body.session)
        except ApiError as exc:
            return error_response(exc)
        value, expires_at = secrets.mint(body.session, body.expires_after.seconds, time.time())
        session = {
            "type": "realtime",
            "object": "realtime.session",
            "model": model_name,
            **body.session,
        }
        return JSONResponse({"value": value, "expires_at": expires_at, "session": session})

    return [Route("/v1/realtime/client_secrets", mint, methods=["POST"])]
