"""Per-session state of the control plane (owned by the orchestrator thread)."""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Literal

from engine.duplex.lease import Lease
from engine.history import ConversationHistory
from engine.messages import ControlResult, Fence, SessionConfig

SessionState = Literal["open", "closing", "closed"]


@dataclass
class TurnJob:
    """One committed user turn (and, if ``respond``, the response to it)."""

    fence: Fence
    audio: bytes
    text: str
    respond: bool
    heard: bool = False  # set by the orchestrator once the user's words are in the history


@dataclass
class CachedOp:
    kind: str
    digest: str
    result: ControlResult


@dataclass
class DuplexSession:
    session_id: str
    config: SessionConfig
    fence: Fence
    lease: Lease
    history: ConversationHistory
    state: SessionState = "open"
    close_reason: str = ""
    audio: bytearray = field(default_factory=bytearray)
    text_parts: list[str] = field(default_factory=list)
    last_seq: int | None = None
    jobs: deque[TurnJob] = field(default_factory=deque)
    active: TurnJob | None = None
    ops: OrderedDict[str, CachedOp] = field(default_factory=OrderedDict)
    # played_ms reported per (turn_id, response_seq), and audio produced per response
    played: dict[tuple[int, int], float] = field(default_factory=dict)

    def has_input(self) -> bool:
        return bool(self.audio) or any(p.strip() for p in self.text_parts)

    def take_input(self) -> tuple[bytes, str]:
        audio, text = bytes(self.audio), " ".join(p for p in self.text_parts if p.strip())
        self.audio.clear()
        self.text_parts.clear()
        return audio, text

    def input_bytes(self) -> int:
        """Input held: uncommitted audio and text, and the committed turns not yet run."""
        jobs = [*self.jobs, self.active] if self.active is not None else self.jobs
        held = len(self.audio) + sum(len(p) for p in self.text_parts)
        return held + sum(len(j.audio) + len(j.text) for j in jobs)

    def pending_turns(self) -> int:
        return len(self.jobs) + (1 if self.active is not None else 0)

    def remember(self, op_id: str, kind: str, digest: str, result: ControlResult, cap: int) -> None:
        self.ops[op_id] = CachedOp(kind, digest, result)
        self.ops.move_to_end(op_id)
        while len(self.ops) > cap:
            self.ops.popitem(last=False)


def digest_of(*parts: object) -> str:
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        h.update(part if isinstance(part, bytes) else repr(part).encode())
        h.update(b"\x00")
    return h.hexdigest()
