"""Per-session state of the control plane (owned by the orchestrator thread)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from duplex_contract.control import ControlResult
from duplex_contract.fence import Fence
from duplex_contract.settings import SessionSettings
from duplex_contract.tools import ResponseOptions, ToolOutput
from engine.duplex.item_book import ItemBook
from engine.duplex.lease import Lease
from engine.duplex.operations import OperationCache
from engine.orchestration.history import ConversationHistory

SessionState = Literal["open", "closing", "closed"]


@dataclass
class TurnJob:
    """One committed user turn (and, if ``respond``, the response to it)."""

    fence: Fence
    audio: bytes
    text: str
    respond: bool
    stream_ms: float | None = None  # where ``audio`` starts on the input clock, if known
    heard: bool = False  # set by the orchestrator once the user's words are in the history
    items: tuple[tuple[str | None, str], ...] = ()  # text items: (item id, text)
    tool_outputs: tuple[ToolOutput, ...] = ()  # function_call_output items
    audio_item: str | None = None  # the user audio item of ``audio``
    audio_deleted: bool = False  # the audio item was deleted: its words stay out
    response: ResponseOptions | None = None  # overrides of this job's response
    traceparent: str | None = None  # the caller's turn span (engine/spans.py)


@dataclass
class DuplexSession:
    session_id: str
    config: SessionSettings
    fence: Fence
    lease: Lease
    history: ConversationHistory
    state: SessionState = "open"
    close_reason: str = ""
    audio: bytearray = field(default_factory=bytearray)
    audio_stream_ms: float | None = None  # where ``audio`` starts on the input clock
    #: the number ``input.pause`` asked its guess's words back with (None: not asked);
    #: until speech resumes or the input is taken
    guess_words: int | None = None
    text_parts: list[str] = field(default_factory=list)
    text_items: list[tuple[str | None, str]] = field(default_factory=list)
    tool_outputs: list[ToolOutput] = field(default_factory=list)
    last_seq: int | None = None
    replica: bytes = b""  # the owning front end's state (engine/duplex/replica.py)
    items: ItemBook = field(default_factory=ItemBook)  # the front end's item records
    open_op: str | None = None  # the operation_id of the open call (a retried open)
    jobs: deque[TurnJob] = field(default_factory=deque)
    active: TurnJob | None = None
    ops: OperationCache = field(default_factory=OperationCache)  # by operation_id
    # played_ms reported per (turn_id, response_seq), and audio produced per response
    played: dict[tuple[int, int], float] = field(default_factory=dict)

    def has_input(self) -> bool:
        return (
            bool(self.audio) or any(p.strip() for p in self.text_parts) or bool(self.tool_outputs)
        )

    def take_input(self) -> tuple[bytes, str]:
        audio, text = bytes(self.audio), " ".join(p for p in self.text_parts if p.strip())
        self.audio.clear()
        self.audio_stream_ms = None
        self.guess_words = None
        self.text_parts.clear()
        self.text_items.clear()
        self.tool_outputs.clear()
        return audio, text

    def take_turn(
        self,
    ) -> tuple[bytes, str, tuple[tuple[str | None, str], ...], tuple[ToolOutput, ...]]:
        """The input so far (audio, joined text, text items, tool outputs); clears it."""
        items, tools = tuple(self.text_items), tuple(self.tool_outputs)
        audio, text = self.take_input()
        return audio, text, items, tools

    def drop_item(self, item_id: str) -> bool:
        """Drop an uncommitted text or tool item; False if it is not in the input."""
        n = len(self.text_items) + len(self.tool_outputs)
        kept = [(i, t) for i, t in self.text_items if i != item_id]
        self.text_items = kept
        self.text_parts = [t for _, t in kept]
        self.tool_outputs = [o for o in self.tool_outputs if o.item_id != item_id]
        return len(self.text_items) + len(self.tool_outputs) != n

    def input_bytes(self) -> int:
        """Input held: uncommitted audio and text, and the committed turns not yet run."""
        jobs = [*self.jobs, self.active] if self.active is not None else self.jobs
        held = len(self.audio) + sum(len(p) for p in self.text_parts)
        return held + sum(len(j.audio) + len(j.text) for j in jobs)

    def pending_turns(self) -> int:
        return len(self.jobs) + (1 if self.active is not None else 0)

    def ok(
        self,
        control_id: int,
        *,
        clamped_ms: float | None = None,
        deduplicated: bool = False,
        replica: bytes | None = None,
        input_seq: int | None = None,
        saved: bool = False,
    ) -> ControlResult:
        """The call succeeded: the session's position and lease generation now."""
        return ControlResult(
            control_id=control_id,
            ok=True,
            session_id=self.session_id,
            accepted_fence=self.fence,
            lease_generation=self.lease.generation,
            clamped_ms=clamped_ms,
            deduplicated=deduplicated,
            replica=replica,
            input_seq=input_seq,
            saved=saved,
        )
