"""Engine errors: defined in :mod:`duplex_contract.errors` (both sides raise and map
them) and re-exported here for the engine's modules.

Errors cross the janus queues as :class:`duplex_contract.events.ErrorInfo` and are
re-raised on the receiving side with ``ErrorInfo.to_exc()``.
"""

from __future__ import annotations

from duplex_contract.errors import RETRYABLE_CODES as RETRYABLE_CODES
from duplex_contract.errors import ConfigError as ConfigError
from duplex_contract.errors import ControlError as ControlError
from duplex_contract.errors import EngineDeadError as EngineDeadError
from duplex_contract.errors import EngineError as EngineError
from duplex_contract.errors import StageError as StageError
from duplex_contract.errors import kind_of as kind_of
from duplex_contract.errors import make_error as make_error
