"""Per-session conversation history for the LLM prompt (pure: no I/O, no clock).

User turns hold ASR (or text) input. Assistant turns hold *text marks*: the text each TTS
audio chunk spoke and that chunk's time span in the response's audio, so that the history can
be cut to what the listener actually heard (``playback_ack`` or
``conversation.item.truncate``). Text-only responses (no audio) hold plain text pieces.

Truncation (:meth:`ConversationHistory.truncate`)
    ``played_ms`` is clamped to ``[0, audio produced]`` and the clamped value is returned.
    The turn then keeps every piece whose audio ended at or before ``played_ms``. A chunk that
    was *partially* played is kept proportionally: ``len(text) * fraction_played`` characters,
    cut back to the last whole word. Everything after that chunk is dropped. A text mark spans
    its chunk plus the following chunks that carry no text (a TTS that puts a segment's text on
    its first chunk only is handled). Text pieces without audio are kept if they come before the
    cut. Truncation is not destructive: the latest call wins (a later ``playback_ack`` with a
    larger ``played_ms`` moves the cut forward), and a truncated turn never shows audio text
    past its cut, even if more chunks are appended afterwards.

Tools and deletion
    A response that called a function holds the call (:meth:`set_tool_call`); a function's
    result (:meth:`add_tool_output`, over ``budget_chars // 2`` characters cut and marked)
    is shown in the prompt as a *system* message where it came, naming the call: "You called
    get_weather with {"city": "Paris"}; it returned {"celsius": 21}."
    (:func:`~duplex_contract.tools.tool_result_note`); the call itself then shows nothing
    more, and a call still without a result is "You called NAME with ARGS.". When such a
    note is the last message of the prompt (the result is not answered yet), it ends with
    :data:`~duplex_contract.tools.TOOL_ANSWER_HINT`. The call JSON as an assistant message
    followed by a ``<tool_response>`` user message made SmolLM2-135M repeat the call JSON as
    its answer (4 of 4); this form makes it answer with the result. User and tool turns
    carry the client's item id; :meth:`delete_item` and :meth:`delete_assistant` drop a
    turn so the next prompt no longer contains it.

Prompt (:meth:`ConversationHistory.messages`)
    The system message, then the turns in order, with contents stripped; an assistant turn
    cut before its end shows what was heard followed by ``... (interrupted)``; empty turns (an
    assistant turn cancelled before any audio was heard) are dropped and consecutive messages
    of one role are merged with ``"\\n"``. The messages after the first are trimmed from the
    oldest so their total length stays within ``budget_chars``: the newest user message is
    always kept (if it alone exceeds the budget only its last ``budget_chars`` characters are
    kept, cut at a word boundary), then the messages after it (tool notes, the answer) while
    they fit, then older messages newest first while they fit; leading assistant and tool
    messages are dropped so the conversation after the system message starts with a user
    message.
    Turns that can no longer reach the prompt are forgotten, so a long session's memory stays
    bounded; truncating a forgotten turn raises ``KeyError`` like an unknown one.

Keeping (:meth:`ConversationHistory.snapshot`, :meth:`ConversationHistory.restore`)
    The turns as plain tagged structs (:data:`TurnState`), for the engine's session store
    (engine/duplex/store.py): a history restored from them renders the same prompt.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from duplex_contract.batch import ChatMessage
from duplex_contract.session_events import ResponseStatus
from duplex_contract.tools import (
    TOOL_ANSWER_HINT,
    ToolCall,
    ToolOutput,
    tool_call_note,
    tool_result_note,
)

__all__ = [
    "AssistantTurnState",
    "ConversationHistory",
    "ToolTurnState",
    "TurnState",
    "UserTurnState",
]

_EPS_MS = 1e-6
_JOIN = "\n"
#: ends an assistant turn the listener cut off, in the prompt: a small model otherwise takes
#: the fragment ("I'm sorry for any") for a whole answer and repeats it
_CUT_MARK = "... (interrupted)"


@dataclass
class _Piece:
    text: str
    start_ms: float | None  # None: text without audio
    end_ms: float = 0.0


@dataclass
class _UserTurn:
    turn_id: int
    text: str
    item_id: str | None = None

    def content(self) -> str:
        return self.text


@dataclass
class _ToolTurn:
    """A function's result (a system note in the prompt)."""

    turn_id: int
    output: ToolOutput
    max_chars: int
    arguments: str | None = None  # of the call it answers, if the history holds it

    @property
    def item_id(self) -> str | None:
        return self.output.item_id

    @property
    def text(self) -> str:
        return self.content()

    def content(self) -> str:
        out = self.output.output
        if len(out) > self.max_chars:
            out = f"{out[: self.max_chars]} ...[{len(out) - self.max_chars} characters cut]"
        return tool_result_note(self.output.name, self.arguments, out)


@dataclass
class _AssistantTurn:
    turn_id: int
    response_seq: int
    pieces: list[_Piece] = field(default_factory=list)
    produced_ms: float = 0.0
    heard_ms: float | None = None  # None: not truncated
    status: ResponseStatus | None = None
    call: ToolCall | None = None

    @property
    def cut(self) -> bool:
        """Truncated before its end: the listener did not hear all of its text."""
        if self.call is not None or self.heard_ms is None:
            return False
        return self.content().strip() != "".join(p.text for p in self.pieces).strip()

    def content(self) -> str:
        if self.call is not None:
            return tool_call_note(self.call.name, self.call.arguments)
        if self.heard_ms is None:
            return "".join(p.text for p in self.pieces)
        heard = self.heard_ms + _EPS_MS
        kept: list[str] = []
        for piece in self.pieces:
            if piece.start_ms is None or piece.end_ms <= heard:
                kept.append(piece.text)
                continue
            if piece.start_ms < self.heard_ms:
                fraction = (self.heard_ms - piece.start_ms) / (piece.end_ms - piece.start_ms)
                kept.append(_cut_at_word(piece.text, int(len(piece.text) * fraction)))
            break
        return "".join(kept)


def _cut_at_word(text: str, n: int) -> str:
    """The first ``n`` characters of ``text``, shortened to end at a whole word."""
    if n >= len(text):
        return text
    if n <= 0:
        return ""
    if text[n].isspace() or text[n - 1].isspace():
        return text[:n]
    cut = max(text.rfind(" ", 0, n), text.rfind("\n", 0, n), text.rfind("\t", 0, n))
    return text[:cut] if cut > 0 else ""


def _keep_tail(text: str, budget: int) -> str:
    """The last ``budget`` characters of ``text`` (stripped), starting at a whole word."""
    if len(text) <= budget:
        return text
    tail = text[-budget:]
    if not text[-budget - 1].isspace() and not tail[0].isspace():
        spaces = [i for i in (tail.find(" "), tail.find("\n"), tail.find("\t")) if i >= 0]
        if spaces:  # else one huge word: cut it by characters
            tail = tail[min(spaces) :]
    return tail.strip()


Role = Literal["user", "assistant", "system"]  # system: a tool note


class UserTurnState(msgspec.Struct, frozen=True, tag="user"):
    turn_id: int
    text: str
    item_id: str | None = None


class ToolTurnState(msgspec.Struct, frozen=True, tag="tool"):
    turn_id: int
    output: ToolOutput
    arguments: str | None = None


class AssistantTurnState(msgspec.Struct, frozen=True, tag="assistant"):
    turn_id: int
    response_seq: int
    pieces: list[tuple[str, float | None, float]] = []  # text, start_ms, end_ms
    produced_ms: float = 0.0
    heard_ms: float | None = None
    status: ResponseStatus | None = None
    call: ToolCall | None = None


#: one turn of a kept history (:meth:`ConversationHistory.snapshot`)
TurnState = UserTurnState | ToolTurnState | AssistantTurnState


class ConversationHistory:
    """User and assistant turns of one session, rendered into a budgeted chat prompt."""

    def __init__(self, budget_chars: int) -> None:
        if budget_chars < 1:
            raise ValueError(f"budget_chars must be >= 1, got {budget_chars}")
        self._budget = budget_chars
        self._turns: list[_UserTurn | _ToolTurn | _AssistantTurn] = []
        self._assistant: dict[tuple[int, int], _AssistantTurn] = {}

    @property
    def budget_chars(self) -> int:
        return self._budget

    def __len__(self) -> int:
        """Turns held in memory (forgotten ones excluded)."""
        return len(self._turns)

    @property
    def nbytes(self) -> int:
        """Characters of text held (an estimate of the memory the history keeps)."""
        total = 0
        for t in self._turns:
            if isinstance(t, _UserTurn):
                total += len(t.text)
            elif isinstance(t, _ToolTurn):
                total += len(t.output.output)  # kept whole; the prompt shows a cut
            else:
                total += sum(len(p.text) for p in t.pieces)
        return total

    # ------------------------------------------------------------------------ recording
    def add_user(self, text: str, turn_id: int, item_id: str | None = None) -> None:
        """Record user input (final ASR text or text input) for ``turn_id``."""
        self._turns.append(_UserTurn(turn_id, text, item_id))
        self._forget_unreachable()

    def add_tool_output(self, output: ToolOutput, turn_id: int) -> None:
        """Record a function's result (a ``function_call_output`` item)."""
        call = next(
            (
                t.call
                for t in self._turns
                if isinstance(t, _AssistantTurn)
                and t.call is not None
                and t.call.call_id == output.call_id
            ),
            None,
        )
        args = call.arguments if call is not None else None
        self._turns.append(_ToolTurn(turn_id, output, max(1, self._budget // 2), args))
        self._forget_unreachable()

    def set_tool_call(self, turn_id: int, response_seq: int, call: ToolCall) -> None:
        """The response ``turn_id/response_seq`` is a call of a function."""
        self._open_turn(turn_id, response_seq).call = call

    def delete_item(self, item_id: str) -> bool:
        """Drop the user or tool turns of ``item_id``; False if none is held."""
        keep = [t for t in self._turns if isinstance(t, _AssistantTurn) or t.item_id != item_id]
        found = len(keep) != len(self._turns)
        self._turns = keep
        return found

    def delete_assistant(self, turn_id: int, response_seq: int) -> bool:
        """Drop an assistant turn (message or call); False if it is not held."""
        turn = self._assistant.pop((turn_id, response_seq), None)
        if turn is None:
            return False
        self._turns.remove(turn)
        return True

    def start_assistant(self, turn_id: int, response_seq: int) -> None:
        """Open an assistant turn; raises ValueError if it was already started."""
        key = (turn_id, response_seq)
        if key in self._assistant:
            raise ValueError(f"assistant turn {turn_id}/{response_seq} already started")
        turn = _AssistantTurn(turn_id, response_seq)
        self._assistant[key] = turn
        self._turns.append(turn)

    def append_assistant(
        self,
        turn_id: int,
        response_seq: int,
        text: str,
        audio_start_ms: float,
        duration_ms: float,
    ) -> None:
        """Record one audio chunk of a response and the text it speaks (may be empty)."""
        if duration_ms < 0 or not math.isfinite(duration_ms) or not math.isfinite(audio_start_ms):
            raise ValueError(f"bad audio span {audio_start_ms} + {duration_ms} ms")
        turn = self._open_turn(turn_id, response_seq)
        end = audio_start_ms + duration_ms
        turn.produced_ms = max(turn.produced_ms, end)
        if text:
            turn.pieces.append(_Piece(text, audio_start_ms, end))
            return
        for piece in reversed(turn.pieces):  # text-less chunk: continues the last text mark
            if piece.start_ms is not None:
                piece.end_ms = max(piece.end_ms, end)
                break

    def append_assistant_text(self, turn_id: int, response_seq: int, text: str) -> None:
        """Record text of a response that has no audio (text-only output)."""
        turn = self._open_turn(turn_id, response_seq)
        if text:
            turn.pieces.append(_Piece(text, None))

    def finish_assistant(self, turn_id: int, response_seq: int, status: ResponseStatus) -> None:
        """Close an assistant turn; later appends to it raise ValueError."""
        self._get(turn_id, response_seq).status = status

    def truncate(self, turn_id: int, response_seq: int, played_ms: float) -> float:
        """Cut an assistant turn to what was heard; returns ``played_ms`` clamped to the audio."""
        if math.isnan(played_ms):
            raise ValueError("played_ms is NaN")
        turn = self._get(turn_id, response_seq)
        clamped = min(max(played_ms, 0.0), turn.produced_ms)
        turn.heard_ms = clamped
        return clamped

    # ------------------------------------------------------------------------ reading
    def assistant_text(self, turn_id: int, response_seq: int) -> str:
        """The text of an assistant turn as the prompt will show it (after truncation)."""
        return self._get(turn_id, response_seq).content()

    def produced_ms(self, turn_id: int, response_seq: int) -> float:
        """Milliseconds of audio recorded for an assistant turn."""
        return self._get(turn_id, response_seq).produced_ms

    def messages(
        self, instructions: str, pending_user: str | None = None
    ) -> tuple[ChatMessage, ...]:
        """System message plus the newest turns that fit in the budget (see module doc).
        ``pending_user``: the prompt as it will be once that user text is added."""
        if pending_user is not None:
            self._turns.append(_UserTurn(-1, pending_user, None))
            try:
                return self.messages(instructions)
            finally:
                self._turns.pop()
        merged = self._merged()
        budget = self._budget
        last_user = max((i for i, (role, _) in enumerate(merged) if role == "user"), default=-1)
        kept: list[tuple[Role, str]] = []
        used = 0
        if last_user >= 0:
            text = _keep_tail(merged[last_user][1], budget)
            kept.append(("user", text))
            used = len(text)
            for role, content in merged[last_user + 1 :]:  # at most one assistant message
                if used + len(content) <= budget:
                    kept.append((role, content))
                    used += len(content)
        older: list[tuple[Role, str]] = []
        head = merged[:last_user] if last_user >= 0 else merged
        for role, content in reversed(head):
            if used + len(content) > budget:
                break
            older.append((role, content))
            used += len(content)
        older.reverse()
        if last_user >= 0:
            while older and older[0][0] != "user":
                older.pop(0)
        turns = [*older, *kept]
        if turns and turns[-1][0] == "system":  # a result not answered yet
            turns[-1] = ("system", f"{turns[-1][1]}\n{TOOL_ANSWER_HINT}")
        system = ChatMessage(role="system", content=instructions)
        return (system, *(ChatMessage(role=r, content=c) for r, c in turns))

    # ------------------------------------------------------------------------ keeping
    def snapshot(self) -> list[TurnState]:
        """The turns held, as plain structs (the engine's session store keeps them)."""
        out: list[TurnState] = []
        for t in self._turns:
            if isinstance(t, _UserTurn):
                out.append(UserTurnState(t.turn_id, t.text, t.item_id))
            elif isinstance(t, _ToolTurn):
                out.append(ToolTurnState(t.turn_id, t.output, t.arguments))
            else:
                pieces = [(p.text, p.start_ms, p.end_ms) for p in t.pieces]
                state = AssistantTurnState(
                    t.turn_id, t.response_seq, pieces, t.produced_ms, t.heard_ms, t.status, t.call
                )
                out.append(state)
        return out

    @classmethod
    def restore(cls, budget_chars: int, turns: list[TurnState]) -> ConversationHistory:
        """A history holding ``turns`` (from :meth:`snapshot`)."""
        history = cls(budget_chars)
        for t in turns:
            if isinstance(t, UserTurnState):
                history._turns.append(_UserTurn(t.turn_id, t.text, t.item_id))
            elif isinstance(t, ToolTurnState):
                tool = _ToolTurn(t.turn_id, t.output, max(1, budget_chars // 2), t.arguments)
                history._turns.append(tool)
            else:
                turn = _AssistantTurn(
                    t.turn_id,
                    t.response_seq,
                    [_Piece(text, start, end) for text, start, end in t.pieces],
                    t.produced_ms,
                    t.heard_ms,
                    t.status,
                    t.call,
                )
                history._assistant[(t.turn_id, t.response_seq)] = turn
                history._turns.append(turn)
        return history

    def unfinished(self) -> list[tuple[int, int]]:
        """The assistant turns not finished yet (their responses were running)."""
        return [k for k, t in self._assistant.items() if t.status is None]

    # ------------------------------------------------------------------------ internals
    def _merged(self) -> list[tuple[Role, str]]:
        answered = {t.output.call_id for t in self._turns if isinstance(t, _ToolTurn)}
        merged: list[tuple[Role, str]] = []
        for turn in self._turns:
            role: Role = "user"
            if isinstance(turn, _ToolTurn):
                role = "system"
            elif isinstance(turn, _AssistantTurn):
                role = "assistant"
                if turn.call is not None:
                    if turn.call.call_id in answered:
                        continue  # its result's note names the call
                    role = "system"
            content = turn.content().strip()
            if not content:
                continue
            if isinstance(turn, _AssistantTurn) and turn.cut:
                content = f"{content}{_CUT_MARK}"
            if merged and merged[-1][0] == role:
                merged[-1] = (role, merged[-1][1] + _JOIN + content)
            else:
                merged.append((role, content))
        return merged

    def _forget_unreachable(self) -> None:
        """Drop the oldest turns that can never be part of a prompt again.

        A prompt is a run of the newest messages. Once the user text newer than a turn is longer
        than the budget, no run that reaches that turn fits (user text never changes), and if
        that turn merges into the newest user message, the kept tail of that message lies
        entirely in the newer text.
        """
        newer_user = 0
        for i in range(len(self._turns) - 1, -1, -1):
            turn = self._turns[i]
            if newer_user > self._budget:
                for old in self._turns[: i + 1]:
                    if isinstance(old, _AssistantTurn):
                        del self._assistant[(old.turn_id, old.response_seq)]
                del self._turns[: i + 1]
                return
            if not isinstance(turn, _AssistantTurn):
                newer_user += len(turn.content().strip())

    def _get(self, turn_id: int, response_seq: int) -> _AssistantTurn:
        try:
            return self._assistant[(turn_id, response_seq)]
        except KeyError:
            raise KeyError(f"unknown assistant turn {turn_id}/{response_seq}") from None

    def _open_turn(self, turn_id: int, response_seq: int) -> _AssistantTurn:
        turn = self._get(turn_id, response_seq)
        if turn.status is not None:
            raise ValueError(f"assistant turn {turn_id}/{response_seq} is already finished")
        return turn
