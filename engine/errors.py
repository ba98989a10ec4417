"""Engine errors.

Exception tree::

    EngineError                 base; carries a wire ``code`` and ``retryable``
    ├── ControlError            a control call was refused (per session, recoverable)
    │     codes: stale_fence, stale_lease, not_found, session_expired, invalid_argument,
    │            input_backpressure, input_audio_buffer_empty, resource_exhausted,
    │            nothing_to_cancel, deadline_exceeded
    ├── StageError              a stage backend failed one request (per request, recoverable)
    │     codes: stage_failed, worker_died, aborted
    ├── ConfigError             bad configuration; names the offending field (start-up only)
    └── EngineDeadError         the engine is gone; every pending and later call fails (fatal)

Errors cross the janus queues as :class:`engine.messages.ErrorInfo` and are re-raised on
the receiving side with :func:`raise_error`.
"""

from __future__ import annotations

from typing import Final

RETRYABLE_CODES: Final = frozenset(
    {"resource_exhausted", "input_backpressure", "deadline_exceeded"}
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
