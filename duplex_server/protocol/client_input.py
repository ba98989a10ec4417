"""The session's client input (sans-I/O): input audio with its VAD decisions, commits,
clears, ``session.update``, created, retrieved and deleted items, keypad digits, the live
transcript of the speech in progress and the idle timeout.

:class:`ClientInput` turns what the client sends (and what the input lane made of its audio)
into engine appends and commits and the events that answer them. It holds the input turns
(:class:`~duplex_server.protocol.input.InputTurns`: the VAD ring and the speech item) and is
given what it shares with the rest of the session: the engine position (the epoch its calls
carry), the conversation, the input numbering, the usage meter, the turn timeline, and the
response tracker, which it asks for responses, cancels and barge-in decisions. The session
configuration is passed in with each input (the session machine owns it).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from duplex_contract.audio import input_ms
from duplex_contract.session_events import UserTranscript
from duplex_contract.settings import SessionUpdate
from duplex_contract.tools import ItemRef, ResponseOptions, ToolOutput
from duplex_server.protocol import dtmf
from duplex_server.protocol import events as ev
from duplex_server.protocol.barge_in import BargeIn
from duplex_server.protocol.codec import decode_audio_b64
from duplex_server.protocol.commands import (
    Action,
    Append,
    Call,
    Commit,
    DeleteItem,
    Discard,
    EndTurn,
    JudgeWords,
    ProcessAudio,
    Send,
    Speculate,
    Update,
    configure_input,
)
from duplex_server.protocol.errors import ProtocolError
from duplex_server.protocol.input import (
    AudioReady,
    InputTurns,
    Onset,
    Paused,
    Resumed,
    Speaking,
    SpeechBegan,
    SpeechEnded,
    TurnStep,
)
from duplex_server.protocol.input_seq import InputSequence
from duplex_server.protocol.items import Conversation, user_text
from duplex_server.protocol.position import EnginePosition
from duplex_server.protocol.response_tracker import ResponseTracker
from duplex_server.protocol.responses import Requested
from duplex_server.protocol.session_config import EffectiveSession, apply_patch
from duplex_server.protocol.timeline import TurnTimeline
from duplex_server.protocol.usage import UsageMeter
from duplex_server.protocol.vad_events import VadEvent

#: client events about the input buffer and the conversation's items
InputEvent = (
    ev.InputAudioBufferAppend
    | ev.InputAudioBufferCommit
    | ev.InputAudioBufferClear
    | ev.ConversationItemCreate
    | ev.ConversationItemRetrieve
    | ev.ConversationItemDelete
)

#: a speech over an answer that ended taken back while its words were on their way waits
#: this long for them (protocol/barge_in.py): past it, it stays dropped
SETTLE_MS = 2500.0

_IDLE_NOTE = "The user has said nothing for a while. Ask them briefly whether they are still there."


class ClientInput:
    """Client input (audio, text, tool output, DTMF) -> engine appends and commits."""

    def __init__(
        self,
        session_id: str,
        position: EnginePosition,
        items: Conversation,
        seqs: InputSequence,
        usage: UsageMeter,
        timeline: TurnTimeline,
        responses: ResponseTracker,
    ) -> None:
        self.session_id = session_id
        self.position = position
        self.items = items
        self.seqs = seqs
        self.usage = usage
        self.timeline = timeline
        self.responses = responses
        #: the speech over an answer and the interruption decision
        self.barge = BargeIn(responses, responses.playout)
        self._guessed = False  # an input.pause was sent for the speech in progress
        #: ``end_of_turn: words``: the pause whose guess's words are awaited or judged now
        #: (guess number, the pause's at_ms, eagerness); None: none
        self._judging: tuple[int, float, str] | None = None
        self._guess_no = 0
        #: a speech over an answer that ended while its words were on their way: (its item,
        #: its last voice, until when its words are waited for); its fate waits with it
        self._settling: tuple[str, float, float] | None = None
        # (not a lambda over self: its reference cycle keeps a closed session until the GC)
        self.turns = InputTurns(functools.partial(items.new_id, "item"))
        self._partials: dict[str, str] = {}  # speech item -> live transcript sent so far

    @property
    def input_ms(self) -> float:
        """The session's input audio clock (processed input, ms)."""
        return self.turns.input_ms

    # ------------------------------------------------------------------ client events
    def on_client_event(
        self, e: InputEvent, config: EffectiveSession, now_ms: float
    ) -> list[Action]:
        """Raises :class:`ProtocolError` (nothing changed) for what cannot be done."""
        if isinstance(e, ev.InputAudioBufferAppend):
            data = decode_audio_b64(e.audio)
            seq = self.seqs.accept(e.input_seq)
            if seq is None or not data:
                return []  # a re-send of input the session has (input_seq), or empty
            self.seqs.audio(seq, config.input_format.duration_ms(len(data)))
            return [ProcessAudio(data)]
        if isinstance(e, ev.InputAudioBufferCommit):
            return self._commit(e.event_id, config)
        if isinstance(e, ev.InputAudioBufferClear):
            return self._clear(e.event_id, now_ms)
        if isinstance(e, ev.ConversationItemCreate):
            seq = self.seqs.accept(e.input_seq)
            return [] if seq is None else self._create_item(e, seq)
        if isinstance(e, ev.ConversationItemRetrieve):
            item = self.items.get(e.item_id)
            if item is None:
                raise ProtocolError("item_not_found", f"no item {e.item_id}", param="item_id")
            return [Send(ev.ItemRetrieved(item=item))]
        return self._delete_item(e.item_id, e.event_id)

    def update(
        self, e: ev.SessionUpdate, config: EffectiveSession
    ) -> tuple[EffectiveSession, list[Action]]:
        """A ``session.update``: the new configuration and what it changes (the engine's
        settings, the input lane's)."""
        new = apply_patch(config, e.session)
        out: list[Action] = []
        if new.settings() != config.settings():
            upd = SessionUpdate.replace_with(new.settings())
            out.append(Call(Update(self.position.epoch, upd, event_id=e.event_id)))
        if (
            new.input_format != config.input_format
            or new.turn_detection != config.turn_detection
            or new.noise_reduction != config.noise_reduction
        ):
            self.turns.reset()
            out.append(configure_input(new))
        out.append(Send(ev.SessionUpdated(session=new.to_wire(self.session_id))))
        return new, out

    def _commit(self, event_id: str | None, config: EffectiveSession) -> list[Action]:
        if not self.turns.buffered:
            raise ProtocolError(
                "input_audio_buffer_commit_empty", "the input audio buffer is empty"
            )
        out = self._steps(self.turns.flush(), config, 0.0)
        self.barge.forget()
        self._give_up()  # (its audio goes with this commit)
        item_id = self.turns.take_speech_item() or self.items.new_id("item")
        out += self._commit_user_audio(item_id, respond=False, event_id=event_id)
        return out

    def _commit_user_audio(
        self, item_id: str, *, respond: bool, event_id: str | None
    ) -> list[Action]:
        self.turns.committed()
        self.usage.committed()
        if respond:
            self.responses.requested()
        commit = Commit(self.position.epoch, respond=respond, event_id=event_id, item_id=item_id)
        return [Call(commit), *self.items.user_audio(item_id)]

    def _clear(self, event_id: str | None, now_ms: float) -> list[Action]:
        out: list[Action] = []
        self.turns.reset()
        self.barge.forget()
        self._give_up()
        if self.turns.uncommitted_ms > 0 or self.turns.uncommitted_text:
            # The engine's input.cancel also drops the work of the current epoch.
            out += self.responses.cancel("input.cancel", "input_cancelled", event_id, now_ms)
            self.turns.committed()
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
        self.turns.uncommitted_text = True
        item_id = item_id if item_id is not None else self.items.new_id("item")
        append = Append(
            self.position.epoch,
            text=text,
            event_id=e.event_id,
            item_id=item_id,
            seq=self.seqs.text(seq),
        )
        return [Call(append), *self.items.user_text(item_id, text)]

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
        self.turns.uncommitted_text = True
        output = ToolOutput(call_id=item.call_id, name=name, output=item.output, item_id=item_id)
        append = Append(
            self.position.epoch,
            event_id=event_id,
            item_id=item_id,
            tool_output=output,
            seq=self.seqs.text(seq),
        )
        return [Call(append), *self.items.tool_output(item_id, item.call_id, item.output)]

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
            Call(DeleteItem(self.position.epoch, ref, event_id=event_id)),
            Send(ev.ItemDeleted(item_id=item_id)),
        ]

    # ------------------------------------------------------------------ keypad digits
    def on_dtmf(
        self, digit: str, received_at: int, config: EffectiveSession, now_ms: float
    ) -> list[Action]:
        """A keypad digit from a phone transport (:mod:`~duplex_server.protocol.dtmf`)."""
        speaking = self.turns.speech_item is not None
        p = dtmf.plan(config, speaking=speaking, response_active=self.responses.active)
        item_id = self.items.new_id("item") if p.as_item else None
        out: list[Action] = [
            Send(ev.DtmfEventReceived(event=digit, received_at=received_at, item_id=item_id))
        ]
        if item_id is None:
            return out
        if p.interrupt:
            out += self.responses.cancel("barge_in", "turn_detected", None, now_ms)
        text = dtmf.dtmf_text(digit)
        self.turns.uncommitted_text = True
        out += [Call(Append(self.position.epoch, text=text, item_id=item_id))]
        out += self.items.user_text(item_id, text)
        if p.respond:  # no speech in progress: the engine's input holds this text only
            self.turns.committed()
            self.usage.committed()
            self.responses.requested()
            out.append(Call(Commit(self.position.epoch, respond=True)))
        return out

    # ------------------------------------------------------------------ transcripts
    def on_transcript(self, event: UserTranscript, now_ms: float) -> list[Action]:
        """The engine's transcript of a user turn (final), or a live hypothesis of the
        speech in progress (a transcription delta of the speech item)."""
        if event.guess is not None:
            return self._guess_words(event.guess, event.text)
        if event.final:
            self.timeline.transcript_ready(now_ms)
        if not event.final and event.fence.turn_id >= self.position.turn_id:
            return self._live_partial(event.text)
        return self.items.transcript(event.fence.turn_id, event.text, event.final)

    def _guess_words(self, guess: int, text: str) -> list[Action]:
        """The words of a pause's guess (``end_of_turn: words``): judged while that pause
        goes on (words of a pause that speech ended since are stale)."""
        judging = self._judging
        if judging is None or judging[0] != guess or self.turns.speech_item is None:
            return []
        return [JudgeWords(guess, text, judging[2])]

    def words_judged(self, guess: int, finished: bool) -> list[Action]:
        """The verdict on a pause guess's words: a finished turn ends at that pause, if it
        still goes on (the input lane checks that); an unfinished one waits for the
        silence window (the eagerness's longest wait) or for more words."""
        judging = self._judging
        if not finished or judging is None or judging[0] != guess:
            return []
        if self.turns.speech_item is None:  # committed or cleared meanwhile
            return []
        return [EndTurn(judging[1])]

    def _live_partial(self, text: str) -> list[Action]:
        """What a live hypothesis adds to the words sent goes out as a transcription delta."""
        item_id = self.turns.speech_item
        if item_id is None:
            return []
        sent = self._partials.get(item_id, "")
        if not text.startswith(sent) or len(text) == len(sent):
            return []  # a revised hypothesis: .completed carries the final transcript
        self._partials = {item_id: text}
        return [Send(ev.InputTranscriptDelta(item_id=item_id, delta=text[len(sent) :]))]

    # ------------------------------------------------------------------ input audio
    def on_audio(
        self, pcm: bytes, vad: Sequence[VadEvent], config: EffectiveSession, now_ms: float
    ) -> list[Action]:
        """One processed chunk (engine input rate) and the VAD decisions it produced."""
        steps = self.turns.on_audio(pcm, vad, config.turn_detection)
        out = self._steps(steps, config, now_ms)
        if self._settling is not None and now_ms >= self._settling[2]:
            out += self._give_up()  # its words did not come: it stays dropped
        return out + self._idle_check(config, now_ms)

    # ------------------------------------------------------------------ speech over answers
    def speech_words(
        self, number: int, text: str, config: EffectiveSession, now_ms: float
    ) -> list[Action]:
        """The words of speech ``number`` over an answer (``TranscribeSpeech`` done)."""
        td = config.turn_detection
        settled = self.barge.settle(td, number, text, now_ms)
        if settled is None:
            return self.barge.words(td, number, text, now_ms)
        out, fate = settled
        pending, self._settling = self._settling, None
        if pending is None:
            return out
        if fate != "commit":
            return out + self._discard()
        item_id, last, _ = pending
        self.timeline.speech_ended(last, now_ms)
        respond = config.create_response
        return out + self._commit_user_audio(item_id, respond=respond, event_id=None)

    def _give_up(self) -> list[Action]:
        """A speech waiting for its words is dropped without them."""
        if self._settling is None:
            return []
        self._settling = None
        self.barge.unsettle()
        return self._discard()

    def _discard(self) -> list[Action]:
        """The engine drops the input not yet committed (a backchannel's)."""
        self.turns.committed()
        self.usage.cleared()
        return [Call(Discard(self.position.epoch))]

    def _idle_check(self, config: EffectiveSession, now_ms: float) -> list[Action]:
        """``idle_timeout_ms`` of silence after a response (and its audio): tell the client
        and prompt the user with a response; once per silence."""
        td = config.turn_detection
        if (
            td is None
            or td.idle_timeout_ms is None
            or self.responses.active
            or self.turns.speech_item is not None
            or config.session_type != "realtime"
        ):
            return []
        since = self.timeline.idle_since(now_ms, td.idle_timeout_ms)
        if since is None:
            return []
        end = int(self.turns.input_ms)
        start = max(0, end - int(now_ms - since))
        item_id = self.items.new_id("item")
        instructions = f"{config.instructions}\n\n{_IDLE_NOTE}".strip()
        options = ResponseOptions(instructions=instructions, tool_choice="none")
        self.responses.requested(Requested(options))
        self.usage.committed()
        return [
            Send(ev.InputTimeoutTriggered(audio_start_ms=start, audio_end_ms=end, item_id=item_id)),
            Call(Commit(self.position.epoch, respond=True, response=options)),
        ]

    def _steps(
        self, steps: Sequence[TurnStep], config: EffectiveSession, now_ms: float
    ) -> list[Action]:
        out: list[Action] = []
        td = config.turn_detection
        for step in steps:
            if isinstance(step, AudioReady):
                self.barge.audio(step.pcm)  # (kept for its words while it is judged)
                self.usage.appended(input_ms(len(step.pcm)))
                seq = self.seqs.processed(self.turns.input_ms)
                epoch = self.position.epoch
                out.append(Call(Append(epoch, audio=step.pcm, stream_ms=step.stream_ms, seq=seq)))
            elif isinstance(step, SpeechBegan):
                self.timeline.silence_broken()  # the user speaks: no idle timeout now
                self._guessed = False
                self._judging = None
                out += self._give_up()  # (before this speech's audio reaches the engine)
                start = int(step.audio_start_ms)
                out.append(Send(ev.SpeechStarted(audio_start_ms=start, item_id=step.item_id)))
                out += self.barge.onset(td, now_ms)
            elif isinstance(step, Speaking):
                out += self.barge.speaking(td, step.speech_ms, now_ms)
            elif isinstance(step, Onset):  # a voice not yet speech: confirm pauses on it
                out += self.barge.candidate(td, now_ms) if step.heard else self.barge.lost(now_ms)
            elif isinstance(step, SpeechEnded):
                self._judging = None
                out += self._speech_ended(step, config, now_ms)
            elif isinstance(step, Paused):
                out += self.barge.quiet(td, True, now_ms)
                if not self.barge.holding:  # (a speech over the answer is not guessed)
                    self._guessed = True
                    respond = config.create_response
                    epoch = self.position.epoch
                    words = None
                    if td is not None and td.end_of_turn == "words":
                        self._guess_no += 1
                        words = self._guess_no
                        self._judging = (words, step.at_ms, td.eagerness or "auto")
                    out.append(Call(Speculate(epoch, "input.pause", respond=respond, words=words)))
            elif isinstance(step, Resumed):
                self._judging = None
                out += self.barge.quiet(td, False, now_ms)
                if self._guessed:
                    self._guessed = False
                    out.append(Call(Speculate(self.position.epoch, "input.resume")))
        return out

    def _speech_ended(
        self, step: SpeechEnded, config: EffectiveSession, now_ms: float
    ) -> list[Action]:
        """The turn ends: committed, or dropped if the speech was taken back (a listener's
        backchannel over the answer: the engine drops its audio, ``input.discard``)."""
        # the moment the last voiced audio arrived: the input clock runs
        # input_ms - audio_end_ms ahead of it
        last = now_ms - max(0.0, self.turns.input_ms - step.audio_end_ms)
        out, fate = self.barge.ended(config.turn_detection, step.speech_ms, now_ms)
        end = int(step.audio_end_ms)
        out.append(Send(ev.SpeechStopped(audio_end_ms=end, item_id=step.item_id)))
        if fate == "settle":  # its words decide: until then it is neither
            self._settling = (step.item_id, last, now_ms + SETTLE_MS)
            return out
        if fate == "discard":
            return out + self._discard()
        self.timeline.speech_ended(last, now_ms)
        respond = config.create_response
        return out + self._commit_user_audio(step.item_id, respond=respond, event_id=None)
