"""What a control call asks the orchestrator to do (engine/duplex/control_plane.py returns
them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from duplex_contract.control import ItemRecord
from duplex_contract.fence import Fence
from engine.duplex.session import TurnJob
from engine.messages import SessionOutput


@dataclass
class Cancel:
    """Stop every piece of work of ``old_epoch``; ``active`` was the running turn job."""

    session_id: str
    old_epoch: int
    active: TurnJob | None
    reason: str


@dataclass(frozen=True)
class ItemChanges:
    """Item records the session store must keep (an :class:`~duplex_contract.control.ItemsCall`
    applied): written alone, not with the whole session."""

    session_id: str
    upserts: tuple[ItemRecord, ...]
    gone: tuple[str, ...]  # deleted, or forgotten past the bound
    state: bytes  # empty: unchanged


@dataclass
class Effects:
    start: list[str] = field(default_factory=list)  # sessions with newly queued jobs
    cancels: list[Cancel] = field(default_factory=list)
    cleanups: list[str] = field(default_factory=list)  # sessions to abort and then finish_close
    events: list[SessionOutput] = field(default_factory=list)
    # ASR ahead of the commit: (fence, input so far, the commit will ask for a response)
    speculate: list[tuple[Fence, bytes, bool]] = field(default_factory=list)
    unspeculate: list[str] = field(default_factory=list)
    heard: list[tuple[str, bytes]] = field(default_factory=list)  # audio for live partials
    input_reset: list[str] = field(default_factory=list)  # the input buffer was taken/cleared
    # committed turns with audio: (session, the job's audio, where it starts on the input clock)
    committed: list[tuple[str, bytes, float | None]] = field(default_factory=list)
    # sessions the session store must keep (whole) before the call's answer goes out
    save: list[str] = field(default_factory=list)
    # ... and item records it must keep (an ItemsCall)
    items: list[ItemChanges] = field(default_factory=list)
