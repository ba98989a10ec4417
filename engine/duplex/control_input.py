"""The fenced calls' jobs once the fence is accepted: append input, commit a turn, touch
the lease (playback marks too), and the non-cancel signals (pause, resume, item.delete,
session.update)."""

from __future__ import annotations

import logging

from duplex_contract.audio import INPUT_RATE
from duplex_contract.control import AppendCall, CommitCall, ControlResult, SignalCall, TouchCall
from duplex_contract.fence import Fence
from duplex_contract.tools import ToolOutput
from engine.duplex.control_core import _err
from engine.duplex.control_epochs import ControlEpochs
from engine.duplex.effects import Effects
from engine.duplex.session import DuplexSession, TurnJob

log = logging.getLogger(__name__)


class ControlInput(ControlEpochs):
    """Input calls, commits, touches and signals on an open session."""

    def _append(
        self, session: DuplexSession, call: AppendCall, control_id: int, effects: Effects
    ) -> ControlResult:
        if call.expected_epoch is not None and call.expected_epoch != session.fence.epoch:
            raise _err(
                "stale_fence",
                f"expected epoch {call.expected_epoch}, current {session.fence.epoch}",
            )
        if not call.audio and not (call.text and call.text.strip()) and call.tool_output is None:
            raise _err("invalid_argument", "append needs audio, text or a tool output")
        if len(call.audio) % 2:
            raise _err("invalid_argument", "audio must be whole PCM16 samples (even byte count)")
        if call.audio and call.sample_rate != INPUT_RATE:
            raise _err("invalid_argument", f"input audio must be {INPUT_RATE} Hz")
        if call.seq is not None and session.last_seq is not None and call.seq <= session.last_seq:
            return self._ok(control_id, session, deduplicated=True)
        size = len(session.audio) + len(call.audio) + sum(map(len, session.text_parts))
        size += len(call.text or "") + sum(len(o.output) for o in session.tool_outputs)
        size += len(call.tool_output.output) if call.tool_output is not None else 0
        if size > self.config.max_input_bytes:
            raise _err(
                "input_backpressure",
                f"input buffer over {self.config.max_input_bytes} bytes; commit or clear",
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
        return self._ok(control_id, session)

    def _commit(
        self, session: DuplexSession, call: CommitCall, control_id: int, effects: Effects
    ) -> ControlResult:
        oob = call.response is not None and call.response.conversation == "none"
        has_input = session.has_input() and not oob  # out of band: the input stays
        if not has_input and not call.respond:
            raise _err("input_audio_buffer_empty", "nothing to commit: the input buffer is empty")
        if session.pending_turns() >= self.config.max_pending_turns:
            raise _err(
                "input_backpressure", f"{self.config.max_pending_turns} turns are already pending"
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
        return self._ok(control_id, session)

    def _touch(
        self, session: DuplexSession, call: TouchCall, control_id: int, now: float
    ) -> ControlResult:
        if call.activity == "detach":
            session.lease.detach(now)
        elif call.activity == "playback_ack":
            mark = call.playback
            if mark is None:
                raise _err(
                    "invalid_argument",
                    "playback_ack needs playback{turn_id, response_seq, played_ms}",
                )
            if mark.played_ms < 0:
                raise _err("invalid_argument", "played_ms must be >= 0")
            key = (mark.turn_id, mark.response_seq)
            active = session.active
            running = (
                active is not None and (active.fence.turn_id, active.fence.response_seq) == key
            )
            if running:  # only the running response's mark is needed (a barge-in cuts it)
                session.played.clear()
                session.played[key] = mark.played_ms
            if mark.truncate or not running:
                try:
                    clamped = session.history.truncate(
                        mark.turn_id, mark.response_seq, mark.played_ms
                    )
                except KeyError:
                    raise _err("invalid_argument", f"no assistant turn {key}") from None
                return self._ok(control_id, session, clamped_ms=clamped)
            return self._ok(control_id, session, clamped_ms=mark.played_ms)
        return self._ok(control_id, session)

    def _signal(
        self, session: DuplexSession, call: SignalCall, control_id: int, effects: Effects
    ) -> ControlResult:
        if call.event == "input.pause":
            if session.audio:
                effects.speculate.append((session.fence, bytes(session.audio), call.respond))
            return self._ok(control_id, session)
        if call.event == "input.resume":
            effects.unspeculate.append(session.session_id)
            return self._ok(control_id, session)
        if call.event == "item.delete":
            return self._delete(session, call, control_id)
        upd = call.update
        if upd is None:
            raise _err("invalid_argument", "session.update needs update")
        session.config = upd.apply(session.config)
        return self._ok(control_id, session)

    def _delete(self, session: DuplexSession, call: SignalCall, control_id: int) -> ControlResult:
        """Drop an item from the input or the history; the next prompt no longer has it.

        A turn queued or still transcribing that took the item drops it too; words already
        in a prompt being answered stay in that one answer only."""
        ref = call.item
        if ref is None:
            raise _err("invalid_argument", "item.delete needs item")
        found = False
        if ref.item_id is not None:
            found = session.drop_item(ref.item_id) or session.history.delete_item(ref.item_id)
            active = [session.active] if session.active is not None else []
            for job in [*session.jobs, *active]:  # taken, not yet in the history
                if ref.item_id in (job.audio_item, *(i for i, _ in job.items)):
                    found = True
                    job.items = tuple((i, t) for i, t in job.items if i != ref.item_id)
                    job.text = " ".join(t for _, t in job.items if t.strip())
                    job.audio_deleted = job.audio_deleted or job.audio_item == ref.item_id
        if ref.turn_id is not None and ref.response_seq is not None:
            found = session.history.delete_assistant(ref.turn_id, ref.response_seq) or found
        if not found:  # e.g. an audio item with no words: nothing to drop, not an error
            log.debug("%s: item.delete found nothing to drop", session.session_id)
        return self._ok(control_id, session)
