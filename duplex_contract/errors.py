"""The errors that cross the engine boundary, with their stable codes.

Exception tree::

    EngineError                 base; carries a stable ``code`` and ``retryable``
    ├── ControlError            a control call was refused (per session, recoverable)
    │     codes: CONTROL_CODES
    ├── StageError              a stage backend failed one request (per request, recoverable)
    │     codes: STAGE_CODES
    ├── ConfigError             bad configuration; names the offending field (start-up only)
    └── EngineDeadError         the engine is gone; every pending and later call fails (fatal)

Errors cross process and thread boundaries as :class:`duplex_contract.session_events.ErrorInfo`
(``ErrorInfo.from_exc`` / ``ErrorInfo.to_exc``).
"""

from __future__ import annotations

from typing import Final

#: codes a ControlError carries (the protocol core maps them to wire codes).
CONTROL_CODES: Final = frozenset(
    {
        "stale_fence",
        "stale_lease",
        "not_found",
        "session_expired",
        "invalid_argument",
        "input_backpressure",
        "input_audio_buffer_empty",
        "resource_exhausted",
        "nothing_to_cancel",
        "deadline_exceeded",
        "item_not_found",
    }
)
#: codes a StageError carries.
#: ``server_busy``: a batch request waited ``engine.scheduling.batch_wait_s`` for room beside
#: the real-time work and did not start (retryable; HTTP 503)
STAGE_CODES: Final = frozenset({"stage_failed", "worker_died", "aborted", "server_busy"})

RETRYABLE_CODES: Final = frozenset(
    {"resource_exhausted", "input_backpressure", "deadline_exceeded", "server_busy"}
)


class EngineError(Exception):
    """Base class of every engine error; ``code`` is the stable wire code."""

    code: str = "internal_error"

    def __init__(self, message: str, *, code: str | None = None, retryable: bool | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code
        self.message = message
        self.retryable = self.code in RETRYABLE_CODES if retryable is None else retryable


class ControlError(EngineError):
    """A duplex control call was refused; the session is unchanged."""

    code = "invalid_argument"


class StageError(EngineError):
    """A stage backend failed a request; other requests are unaffected."""

    code = "stage_failed"


class ConfigError(EngineError):
    """Invalid configuration. The message names the field, e.g. ``stages.llm.replicas``."""

    code = "invalid_config"


class EngineDeadError(EngineError):
    """The engine died or was shut down; nothing more will be served."""

    code = "engine_dead"


_BY_KIND: Final[dict[str, type[EngineError]]] = {
    "control": ControlError,
    "stage": StageError,
    "config": ConfigError,
    "dead": EngineDeadError,
    "engine": EngineError,
}


def kind_of(exc: EngineError) -> str:
    for kind, cls in _BY_KIND.items():
        if type(exc) is cls:
            return kind
    return "engine"


def make_error(kind: str, code: str, message: str, retryable: bool) -> EngineError:
    cls = _BY_KIND.get(kind, EngineError)
    return cls(message, code=code, retryable=retryable)
