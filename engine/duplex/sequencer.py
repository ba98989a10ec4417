"""Input sequencing: a session's input buffer (appended audio, text and tool outputs, each
client append seq taken once) and the turns a commit makes of it, within the configured
bounds (``max_input_bytes``, ``max_pending_turns``)."""

from __future__ import annotations

from duplex_contract.audio import INPUT_RATE
from duplex_contract.control import AppendCall, CommitCall, ControlResult
from duplex_contract.errors import ControlError
from duplex_contract.fence import Fence
from duplex_contract.tools import ToolOutput
from engine.config import DuplexRuntimeConfig
from engine.duplex.effects import Effects
from engine.duplex.session import DuplexSession, TurnJob


class InputSequencer:
    """Appends and commits on an open session whose fence was accepted."""

    def __init__(self, config: DuplexRuntimeConfig) -> None:
        self.max_input_bytes = config.max_input_bytes
        self.max_pending_turns = config.max_pending_turns

    def append(
        self, session: DuplexSession, call: AppendCall, control_id: int, effects: Effects
    ) -> ControlResult:
        """Add input; a client seq the engine already has is a resend (``deduplicated``)."""
        if call.expected_epoch is not None and call.expected_epoch != session.fence.epoch:
            raise ControlError(
                f"expected epoch {call.expected_epoch}, current {session.fence.epoch}",
                code="stale_fence",
            )
        if not call.audio and not (call.text and call.text.strip()) and call.tool_output is None:
            raise ControlError("append needs audio, text or a tool output", code="invalid_argument")
        if len(call.audio) % 2:
            raise ControlError(
                "audio must be whole PCM16 samples (even byte count)", code="invalid_argument"
            )
        if call.audio and call.sample_rate != INPUT_RATE:
            raise ControlError(f"input audio must be {INPUT_RATE} Hz", code="invalid_argument")
        if call.seq is not None and session.last_seq is not None and call.seq <= session.last_seq:
            return session.ok(control_id, deduplicated=True)
        size = len(session.audio) + len(call.audio) + sum(map(len, session.text_parts))
        size += len(call.text or "") + sum(len(o.output) for o in session.tool_outputs)
        size += len(call.tool_output.output) if call.tool_output is not None else 0
        if size > self.max_input_bytes:
            raise ControlError(
                f"input buffer over {self.max_input_bytes} bytes; commit or clear",
                code="input_backpressure",
            )
        if call.audio and not session.audio:
            session.audio_stream_ms = call.stream_ms
        session.audio += call.audio
        if call.audio:
            effects.heard.append((session.session_id, call.audio))
        if call.text:
            session.text_parts.append(call.text)
            session.text_items.append((call.item_id, call.text))
        if call.tool_output is not None:
            session.tool_outputs.append(call.tool_output)
        if call.seq is not None:
            session.last_seq = call.seq
        return session.ok(control_id)

    def commit(
        self, session: DuplexSession, call: CommitCall, control_id: int, effects: Effects
    ) -> ControlResult:
        """The input so far becomes a turn (and, if ``respond``, a response is asked for):
        the turn and response counters advance and the turn job is queued."""
        oob = call.response is not None and call.response.conversation == "none"
        has_input = session.has_input() and not oob  # out of band: the input stays
        if not has_input and not call.respond:
            raise ControlError(
                "nothing to commit: the input buffer is empty", code="input_audio_buffer_empty"
            )
        if session.pending_turns() >= self.max_pending_turns:
            raise ControlError(
                f"{self.max_pending_turns} turns are already pending", code="input_backpressure"
            )
        audio, text = b"", ""
        stream_ms = session.audio_stream_ms
        items: tuple[tuple[str | None, str], ...] = ()
        tools: tuple[ToolOutput, ...] = ()
        if not oob:
            audio, text, items, tools = session.take_turn()
            effects.input_reset.append(session.session_id)
        f = session.fence
        session.fence = Fence(
            f.session_id,
            f.epoch,
            f.turn_id + (1 if has_input else 0),
            f.response_seq + (1 if call.respond else 0),
        )
        session.jobs.append(
            TurnJob(
                fence=session.fence,
                audio=audio,
                text=text,
                respond=call.respond,
                stream_ms=stream_ms if audio else None,
                items=items,
                tool_outputs=tools,
                audio_item=call.item_id if audio else None,
                response=call.response if call.respond else None,
                traceparent=call.traceparent,
            )
        )
        if audio:
            effects.committed.append((session.session_id, audio, stream_ms))
        effects.start.append(session.session_id)
        return session.ok(control_id)
