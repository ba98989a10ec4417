"""What a front end keeps to take its sessions back to an engine that restarted (pure: no
I/O; engine/api/remote_client.py's ``ReconnectingLink`` uses it).

For each session this front end opened or resumed and has not closed: its lease generation
(a session is attached again with ``ResumeCall(reattach=True)`` at that generation), and the
appends the engine answered without ``saved``. The engine's session store holds a session as
the last ``saved`` answer left it, so a restarted engine lacks those appends; they are sent
again, in order, right after the session is attached again (each with its own
``operation_id``: a repeat acts once). A ``saved`` answer drops the ones before it.
"""

from __future__ import annotations

from collections.abc import Callable

from duplex_contract.control import (
    AppendCall,
    CloseCall,
    ControlCall,
    ControlResult,
    OpenCall,
    ResumeCall,
)


class KeptSessions:
    """The open sessions' lease generations and the appends the engine has not saved."""

    def __init__(self) -> None:
        self.owned: dict[str, int] = {}  # session id -> lease generation
        self.unsaved: dict[str, list[AppendCall]] = {}

    def answered(self, call: ControlCall, result: ControlResult) -> None:
        """A call succeeded: keep what a restart needs of it."""
        sid = result.session_id
        if sid is None:
            return
        if isinstance(call, CloseCall):
            self.forget(sid)
            return
        if isinstance(call, OpenCall) or (isinstance(call, ResumeCall) and not call.peek):
            self.owned[sid] = result.lease_generation
        elif sid not in self.owned:
            return
        if result.saved:
            self.unsaved.pop(sid, None)
        elif isinstance(call, AppendCall) and not result.deduplicated:
            self.unsaved.setdefault(sid, []).append(call)

    def forget(self, sid: str) -> None:
        self.owned.pop(sid, None)
        self.unsaved.pop(sid, None)

    def to_attach(self, still_open: Callable[[str], bool]) -> dict[str, int]:
        """The sessions to attach again (those whose stream is still read); the others are
        forgotten."""
        for sid in [s for s in self.owned if not still_open(s)]:
            self.forget(sid)
        return dict(self.owned)

    def take_unsaved(self, sid: str) -> list[AppendCall]:
        return self.unsaved.pop(sid, [])
