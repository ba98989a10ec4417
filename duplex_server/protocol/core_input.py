"""The session core's input turns: input audio with its VAD decisions, commits, clears,
created items, deletes, truncation and the idle timeout (sans-I/O)."""

from __future__ import annotations

from collections.abc import Sequence

from duplex_contract.audio import input_ms
from duplex_contract.control import PlaybackMark
from duplex_contract.settings import SessionUpdate
from duplex_contract.tools import (
    ItemRef,
    ResponseOptions,
    ToolOutput,
)
from duplex_server.protocol import dtmf
from duplex_server.protocol import events as ev
from duplex_server.protocol.commands import (
    Action,
    Append,
    Call,
    Commit,
    ConfigureInput,
    DeleteItem,
    Send,
    Speculate,
    Touch,
    Update,
)
from duplex_server.protocol.config import (
    apply_patch,
)
from duplex_server.protocol.core_responses import CoreResponses
from duplex_server.protocol.errors import ProtocolError
from duplex_server.protocol.input import (
    AudioReady,
    Paused,
    Resumed,
    Speaking,
    SpeechBegan,
    SpeechEnded,
    TurnStep,
)
from duplex_server.protocol.items import user_text
from duplex_server.protocol.responses import (
    Requested,
)
from duplex_server.protocol.vad import VadEvent


class CoreInput(CoreResponses):
    """Client input (audio, text, tool output, DTMF) -> engine appends and commits."""

    def frame_received(self, nbytes: int) -> None:
        """A binary audio frame of ``nbytes`` arrived: it is numbered implicitly."""
        seq = self.seqs.accept(None)
        assert seq is not None
        self.seqs.audio(seq, self.config.input_format.duration_ms(nbytes))

    def audio_received(self, nbytes: int) -> None:
        """The transport handed the session ``nbytes`` of input audio (its input format)."""
        self.usage.received(self.config.input_format.duration_ms(nbytes))

    def on_dtmf(self, digit: str, received_at: int, now_ms: float) -> list[Action]:
        """A keypad digit from a phone transport (:mod:`~duplex_server.protocol.dtmf`)."""
        if self.closed:
            return []
        self.now_ms = now_ms
        speaking = self.input.speech_item is not None
        p = dtmf.plan(self.config, speaking=speaking, response_active=self.responses.active)
        item_id = self.items.new_id("item") if p.as_item else None
        out: list[Action] = [
            Send(ev.DtmfEventReceived(event=digit, received_at=received_at, item_id=item_id))
        ]
        if item_id is None:
            return out
        if p.interrupt:
            out += self._cancel("barge_in", "turn_detected", None)
        text = dtmf.dtmf_text(digit)
        self.input.uncommitted_text = True
        out += [Call(Append(self.epoch, text=text, item_id=item_id))]
        out += self.items.user_text(item_id, text)
        if p.respond:  # no speech in progress: the engine's input holds this text only
            self.input.committed()
            self.usage.committed()
            self.responses.requested()
            out.append(Call(Commit(self.epoch, respond=True)))
        return out

    def _update(self, e: ev.SessionUpdate) -> list[Action]:
        old = self.config
        new = apply_patch(old, e.session)
        self.config = new
        out: list[Action] = []
        if new.settings() != old.settings():
            upd = SessionUpdate.replace_with(new.settings())
            out.append(Call(Update(self.epoch, upd, event_id=e.event_id)))
        if (
            new.input_format != old.input_format
            or new.turn_detection != old.turn_detection
            or new.noise_reduction != old.noise_reduction
        ):
            self.input.reset()
            out.append(ConfigureInput(new.input_format, new.turn_detection, new.noise_reduction))
        out.append(Send(ev.SessionUpdated(session=new.to_wire(self.session_id))))
        return out

    def _commit_input(self, event_id: str | None) -> list[Action]:
        if not self.input.buffered:
            raise ProtocolError(
                "input_audio_buffer_commit_empty", "the input audio buffer is empty"
            )
        out = self._steps(self.input.flush(), 0.0)
        item_id = self.input.take_speech_item() or self.items.new_id("item")
        out += self._commit_user_audio(item_id, respond=False, event_id=event_id)
        return out

    def _commit_user_audio(
        self, item_id: str, *, respond: bool, event_id: str | None
    ) -> list[Action]:
        self.input.committed()
        self.usage.committed()
        if respond:
            self.responses.requested()
        call = Call(Commit(self.epoch, respond=respond, event_id=event_id, item_id=item_id))
        return [call, *self.items.user_audio(item_id)]

    def _clear_input(self, event_id: str | None) -> list[Action]:
        out: list[Action] = []
        self.input.reset()
        if self.input.uncommitted_ms > 0 or self.input.uncommitted_text:
            # The engine's input.cancel also drops the work of the current epoch.
            out += self._cancel("input.cancel", "input_cancelled", event_id)
            self.input.committed()
            self.usage.cleared()
        out.append(Send(ev.InputCleared()))
        return out

    def _create_item(self, e: ev.ConversationItemCreate, seq: int) -> list[Action]:
        item_id = e.item.id if isinstance(e.item.id, str) else None
        if item_id is not None and self.items.get(item_id) is not None:
            raise ProtocolError("invalid_value", f"item {item_id} exists", param="item.id")
        if e.item.type == "function_call_output":
            return self._tool_output(e.item, item_id, e.event_id, seq)
        if e.item.type != "message":
            raise ProtocolError(
                "unsupported",
                "items of this type cannot be created (message, function_call_output)",
                param="item.type",
            )
        text = user_text(e.item)  # raises ProtocolError for what cannot be created
        self.input.uncommitted_text = True
        item_id = item_id if item_id is not None else self.items.new_id("item")
        return [
            Call(
                Append(
                    self.epoch,
                    text=text,
                    event_id=e.event_id,
                    item_id=item_id,
                    seq=self.seqs.text(seq),
                )
            ),
            *self.items.user_text(item_id, text),
        ]

    def _tool_output(
        self, item: ev.ItemParam, item_id: str | None, event_id: str | None, seq: int
    ) -> list[Action]:
        """A function's result: into the engine's history with the next commit."""
        if not isinstance(item.call_id, str):
            raise ProtocolError("invalid_event", "call_id is required", param="item.call_id")
        if not isinstance(item.output, str):
            raise ProtocolError("invalid_event", "output is required", param="item.output")
        name = self.items.calls.get(item.call_id)
        if name is None:
            raise ProtocolError(
                "invalid_value",
                f"no function call {item.call_id} in this conversation",
                param="item.call_id",
            )
        item_id = item_id if item_id is not None else self.items.new_id("item")
        self.input.uncommitted_text = True
        output = ToolOutput(call_id=item.call_id, name=name, output=item.output, item_id=item_id)
        return [
            Call(
                Append(
                    self.epoch,
                    event_id=event_id,
                    item_id=item_id,
                    tool_output=output,
                    seq=self.seqs.text(seq),
                )
            ),
            *self.items.tool_output(item_id, item.call_id, item.output),
        ]

    def _delete_item(self, item_id: str, event_id: str | None) -> list[Action]:
        item = self.items.get(item_id)
        if item is None:
            raise ProtocolError("item_not_found", f"no item {item_id}", param="item_id")
        current = self.responses.current
        if current is not None and current.item_id == item_id:
            raise ProtocolError(
                "invalid_state",
                "the item of the response in progress cannot be deleted (cancel it first)",
                param="item_id",
            )
        turn = self.items.turn_of(item_id)
        ref = (
            ItemRef(item_id=item_id)
            if turn is None
            else ItemRef(turn_id=turn[0], response_seq=turn[1])
        )
        self.items.forget(item_id)
        return [
            Call(DeleteItem(self.epoch, ref, event_id=event_id)),
            Send(ev.ItemDeleted(item_id=item_id)),
        ]

    def _truncate(
        self, item_id: str, played_ms: float, event_id: str | None, *, truncate: bool
    ) -> list[Action]:
        rec = self.items.assistant_record(item_id)
        if rec is None:
            raise ProtocolError(
                "item_not_found", f"no assistant audio item {item_id}", param="item_id"
            )
        turn, resp, sent_ms = rec
        current = self.responses.current
        if current is not None and current.item_id == item_id:
            sent_ms = current.audio_ms
        applied = min(played_ms, sent_ms)
        mark = PlaybackMark(turn, resp, applied, truncate)
        touch = Touch(self.epoch, "playback_ack", mark, event_id=event_id)
        if truncate:
            event: ev.ServerEvent = ev.ItemTruncated(
                item_id=item_id,
                content_index=0,
                audio_end_ms=int(applied),
                requested_audio_end_ms=int(played_ms),
            )
        else:
            event = ev.PlaybackAcknowledged(
                item_id=item_id, played_ms=applied, requested_played_ms=played_ms
            )
        return [Call(touch), Send(event)]

    # ------------------------------------------------------------------ input audio
    def on_input_audio(self, pcm: bytes, vad: Sequence[VadEvent], now_ms: float) -> list[Action]:
        """One processed chunk (engine input rate) and the VAD decisions it produced."""
        if self.closed:
            return []
        self.now_ms = now_ms
        out = self._steps(self.input.on_audio(pcm, vad, self.config.turn_detection), now_ms)
        return out + self._idle_check(now_ms)

    def _idle_check(self, now_ms: float) -> list[Action]:
        """``idle_timeout_ms`` of silence after a response (and its audio): tell the client
        and prompt the user with a response; once per silence."""
        td = self.config.turn_detection
        since = self.idle_since_ms
        if (
            td is None
            or td.idle_timeout_ms is None
            or since is None
            or self.responses.active
            or self.input.speech_item is not None
            or now_ms - since < td.idle_timeout_ms
            or self.config.session_type != "realtime"
        ):
            return []
        self.idle_since_ms = None
        end = int(self.input.input_ms)
        start = max(0, end - int(now_ms - since))
        item_id = self.items.new_id("item")
        note = (
            "The user has said nothing for a while. Ask them briefly whether they are still there."
        )
        instructions = f"{self.config.instructions}\n\n{note}".strip()
        options = ResponseOptions(instructions=instructions, tool_choice="none")
        self.responses.requested(Requested(options))
        self.usage.committed()
        return [
            Send(ev.InputTimeoutTriggered(audio_start_ms=start, audio_end_ms=end, item_id=item_id)),
            Call(Commit(self.epoch, respond=True, response=options)),
        ]

    def _steps(self, steps: Sequence[TurnStep], now_ms: float) -> list[Action]:
        out: list[Action] = []
        for step in steps:
            if isinstance(step, AudioReady):
                self.usage.appended(input_ms(len(step.pcm)))
                seq = self.seqs.processed(self.input.input_ms)
                append = Append(self.epoch, audio=step.pcm, stream_ms=step.stream_ms, seq=seq)
                out.append(Call(append))
            elif isinstance(step, SpeechBegan):
                self.idle_since_ms = None  # the user speaks: no idle timeout this silence
                start = int(step.audio_start_ms)
                out.append(Send(ev.SpeechStarted(audio_start_ms=start, item_id=step.item_id)))
            elif isinstance(step, Speaking):
                out += self._maybe_barge_in(now_ms, step.speech_ms)
            elif isinstance(step, SpeechEnded):
                # the moment the last voiced audio arrived: the input clock runs
                # input_ms - audio_end_ms ahead of it
                last = now_ms - max(0.0, self.input.input_ms - step.audio_end_ms)
                self.turn_moments = {"last_voice": last, "speech_stopped": now_ms}
                out += self._maybe_barge_in(now_ms, step.speech_ms)
                end = int(step.audio_end_ms)
                out.append(Send(ev.SpeechStopped(audio_end_ms=end, item_id=step.item_id)))
                respond = self.config.create_response
                out += self._commit_user_audio(step.item_id, respond=respond, event_id=None)
            elif isinstance(step, Paused):
                respond = self.config.create_response
                out.append(Call(Speculate(self.epoch, "input.pause", respond=respond)))
            elif isinstance(step, Resumed):
                out.append(Call(Speculate(self.epoch, "input.resume")))
        return out
