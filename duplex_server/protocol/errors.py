"""Wire error codes, close codes, and the one function that maps exceptions to wire errors.

Exception tree::

    ProtocolError               a client event was refused; the session goes on (recoverable)
    ├── (code) invalid_json, unknown_event, invalid_event, invalid_audio,
    │          invalid_audio_frame, invalid_value,
    │          unsupported, item_not_found, response_cancel_not_active,
    │          conversation_already_has_active_response, input_audio_buffer_commit_empty,
    │          invalid_state, resync_required, ...
    └── SessionFatal            the session (or this socket) ends after the error is sent;
                                carries the WebSocket close code
                                (resource_exhausted 1013, unauthorized 1008, client_too_slow
                                1008, frame_too_large 1009, engine_unavailable 1011,
                                server_shutdown 1001, ...)

Engine errors (:mod:`duplex_contract.errors`) are mapped by :func:`to_wire_error` through
their ``code``; anything unexpected becomes ``server_error`` and never leaks a traceback
(the caller logs it).
"""

from __future__ import annotations

from typing import Final

from duplex_contract.errors import ControlError, EngineDeadError, EngineError
from duplex_server.protocol.events import ErrorDetail


class CloseCode:
    """WebSocket close codes used by the server (RFC 6455 §7.4.1)."""

    NORMAL: Final = 1000  # after session.closed / session.expired / session.replaced
    GOING_AWAY: Final = 1001  # server shutting down
    POLICY: Final = 1008  # auth refused, origin refused, client too slow
    TOO_BIG: Final = 1009  # frame over the size cap
    INTERNAL: Final = 1011  # the engine died
    SERVICE_RESTART: Final = 1012  # after session.handover: resume on another front end
    TRY_AGAIN: Final = 1013  # capacity: no session slot free, or this front end is draining


#: engine ControlError codes -> (wire code, error type). Unlisted codes keep their name.
_ENGINE_CODES: Final[dict[str, str]] = {
    "input_audio_buffer_empty": "input_audio_buffer_commit_empty",
    "nothing_to_cancel": "response_cancel_not_active",
    "not_found": "session_not_found",
}

#: wire codes that end the socket, with their close code.
FATAL_CODES: Final[dict[str, int]] = {
    "resource_exhausted": CloseCode.TRY_AGAIN,
    "unauthorized": CloseCode.POLICY,
    "invalid_client_secret": CloseCode.POLICY,  # forged, or another server's
    "client_secret_expired": CloseCode.POLICY,
    "client_secret_used": CloseCode.POLICY,  # a secret opens one session
    "client_secret_wrong_route": CloseCode.POLICY,  # e.g. Twilio: an API key is needed
    "origin_not_allowed": CloseCode.POLICY,
    "client_too_slow": CloseCode.POLICY,
    "frame_too_large": CloseCode.TOO_BIG,
    "engine_unavailable": CloseCode.INTERNAL,
    "server_shutdown": CloseCode.GOING_AWAY,  # the server stops; the session is over
    "session_expired": CloseCode.NORMAL,
    "session_not_found": CloseCode.POLICY,
    "invalid_resume_token": CloseCode.POLICY,
    "stale_lease": CloseCode.POLICY,
    "resume_timeout": CloseCode.POLICY,
}

#: every wire error code the server sends (docs/protocol.md lists each one).
ERROR_CODES: Final = frozenset(
    {
        "invalid_json",
        "unknown_event",
        "invalid_event",
        "invalid_audio",
        "invalid_audio_frame",
        "invalid_value",
        "unsupported",
        "item_not_found",
        "invalid_state",
        "response_cancel_not_active",
        "conversation_already_has_active_response",
        "input_audio_buffer_commit_empty",
        "input_backpressure",
        "stale_fence",
        "deadline_exceeded",
        "server_error",
        "simulated_stages",
        *FATAL_CODES,
    }
)


class ProtocolError(Exception):
    """A client event was refused with a wire error; the session is unchanged."""

    def __init__(
        self,
        code: str,
        message: str,
        *,
        param: str | None = None,
        event_id: str | None = None,
        error_type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.event_id = event_id
        self.error_type = error_type


#: wire codes that are the server's fault, not the client's: error type ``server_error``
#: (as over HTTP), every other code is an ``invalid_request_error``
SERVER_CODES: Final = frozenset({"engine_unavailable", "server_error", "server_shutdown"})


class SessionFatal(ProtocolError):
    """The error ends the socket with ``close_code`` after the error event is sent."""

    def __init__(
        self,
        code: str,
        message: str,
        *,
        close_code: int | None = None,
        error_type: str | None = None,
    ) -> None:
        kind = error_type or ("server_error" if code in SERVER_CODES else "invalid_request_error")
        super().__init__(code, message, error_type=kind)
        self.close_code = close_code if close_code is not None else FATAL_CODES.get(code, 1011)


def to_wire_error(
    exc: BaseException, *, event_id: str | None = None
) -> tuple[ErrorDetail, int | None]:
    """Map any exception to ``(error detail, close code or None)``. The one place that does it."""
    if isinstance(exc, ProtocolError):
        close = exc.close_code if isinstance(exc, SessionFatal) else None
        detail = ErrorDetail(
            type=exc.error_type,
            code=exc.code,
            message=exc.message,
            param=exc.param,
            event_id=exc.event_id or event_id,
        )
        return detail, close
    if isinstance(exc, EngineDeadError):
        detail = ErrorDetail(
            type="server_error",
            code="engine_unavailable",
            message="the engine is not running",
            event_id=event_id,
        )
        return detail, CloseCode.INTERNAL
    if isinstance(exc, ControlError):
        code = _ENGINE_CODES.get(exc.code, exc.code)
        detail = ErrorDetail(
            type="invalid_request_error" if not exc.retryable else "rate_limit_error",
            code=code,
            message=exc.message,
            event_id=event_id,
        )
        return detail, FATAL_CODES.get(code)
    if isinstance(exc, EngineError):
        detail = ErrorDetail(
            type="server_error", code=exc.code, message=exc.message, event_id=event_id
        )
        return detail, None
    detail = ErrorDetail(
        type="server_error", code="server_error", message="internal error", event_id=event_id
    )
    return detail, None
