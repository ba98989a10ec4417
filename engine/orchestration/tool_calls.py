"""Streams a function call's arguments out of the model's call JSON as it is generated.

The model writes ``{"name": "NAME", "arguments": {...}}`` (its decoding is constrained to
that shape, duplex_contract.tools). :class:`CallStream` finds the name once the head is
complete and then passes the arguments text on as deltas, holding back a trailing run of
``}`` and whitespace (the outer object's close is among it) until more text shows it is not
the end. :meth:`CallStream.finish` returns the last delta; the deltas joined are the
arguments text exactly as the model wrote it.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from duplex_contract.errors import StageError
from duplex_contract.fence import Fence
from duplex_contract.session_events import FunctionCallDelta, FunctionCallDone, SessionEvent
from duplex_contract.settings import Tool
from duplex_contract.tools import ToolCall, ToolCallError, check_call

_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
_TAIL = re.compile(r"[\s}]*\Z")


class CallStream:
    def __init__(self) -> None:
        self.text = ""
        self.name: str | None = None
        self._start: int | None = None
        self._sent = 0

    def push(self, piece: str) -> str:
        """Add generated text; returns the arguments delta it completes (may be "")."""
        self.text += piece
        if self._start is None:
            match = _HEAD.match(self.text)
            if match is None:
                return ""
            self.name, self._start = match.group(1), match.end()
        if self._sent == 0:  # whitespace before the arguments may come in a later piece
            body = self.text[self._start :]
            self._start += len(body) - len(body.lstrip())
        body = self.text[self._start :]
        tail = _TAIL.search(body)
        keep = tail.start() if tail is not None else len(body)
        delta = body[self._sent : keep]
        self._sent = max(self._sent, keep)
        return delta

    def arguments(self) -> str | None:
        """The arguments text (the outer object's close removed); None if no head was seen."""
        if self._start is None:
            return None
        body = self.text[self._start :].rstrip()
        if body.endswith("}"):
            body = body[:-1].rstrip()
        return body

    def finish(self) -> str:
        """The rest of the arguments after the last delta."""
        args = self.arguments()
        return "" if args is None else args[self._sent :]


def finish_call(
    calls: CallStream,
    call_id: str,
    tools: tuple[Tool, ...],
    fence: Fence,
    emit: Callable[[SessionEvent], None],
    record: Callable[[ToolCall], None] | None = None,
) -> None:
    """Validate the call the model wrote and announce it: the rest of its arguments as a
    delta (or all of them, when the model did not write the expected layout), then the
    done event (``record`` gets the call before it). An invalid call raises
    :class:`StageError` ``invalid_tool_call``."""
    try:
        call = check_call(calls.text, tools)
    except ToolCallError as exc:
        raise StageError(str(exc), code="invalid_tool_call") from None
    args = calls.arguments()
    if args is None or calls.name != call.name:  # not the expected layout: send it whole
        args = call.arguments
        emit(FunctionCallDelta(fence=fence, call_id=call_id, name=call.name, delta=args))
    else:
        rest = calls.finish()
        if rest:
            emit(FunctionCallDelta(fence=fence, call_id=call_id, name=call.name, delta=rest))
    if record is not None:
        record(ToolCall(call_id=call_id, name=call.name, arguments=args))
    emit(FunctionCallDone(fence=fence, call_id=call_id, name=call.name, arguments=args))
