"""Usage accounting (pure): the tokens and audio seconds of each response and of a session.

A response's ``usage`` (docs/protocol.md §5.11) counts:

* input text tokens: the LLM's prompt as the engine reports it (instructions, history and
  this turn's words; ``cached_tokens`` is 0: no backend reports its prompt cache);
* input audio: the user audio the response answers, i.e. the audio committed into the
  conversation since the previous response began (a server-VAD turn: its speech, the prefix
  padding and the silence window), at :data:`INPUT_AUDIO_TOKENS_PER_S`;
* output text tokens: the tokens the LLM generated (0 for a response the server cancelled:
  the engine stops the LLM without counting);
* output audio: the audio the response produced (``response.audio_ms``; a cancelled
  response's audio up to the cancel, some of which may never have been written), at
  :data:`OUTPUT_AUDIO_TOKENS_PER_S`.

Audio tokens are OpenAI's published rates for its realtime models (user audio 1 token per
100 ms, assistant audio 1 token per 50 ms), rounded up per response: the engine's models do
not read or write audio tokens (Whisper and the TTS sit around a text LLM), so this is a
billing unit, not a count of work; ``input_audio_seconds`` / ``output_audio_seconds`` give
the measure itself.

:class:`UsageMeter` keeps one session's figures: audio appended to the engine and not yet
committed, committed and not yet answered, all audio received, and the sum of its
responses' usage (``session.closed.usage``). They move with the session to a front end that
takes it over (:class:`UsageState`, kept in the engine with the items; docs/scale.md).
"""

from __future__ import annotations

import math

import msgspec

from duplex_server.protocol import events as ev

#: OpenAI's rate for user audio: 1 token per 100 ms
INPUT_AUDIO_TOKENS_PER_S = 10
#: OpenAI's rate for assistant audio: 1 token per 50 ms
OUTPUT_AUDIO_TOKENS_PER_S = 20


def audio_tokens(ms: float, per_s: int) -> int:
    """Tokens for ``ms`` of audio at ``per_s`` tokens a second, rounded up (1 ms slack for
    float durations: 100.0000001 ms is still one input token)."""
    return max(0, math.ceil(round(ms * per_s / 1000.0, 3)))


def response_usage(
    *, input_text: int, output_text: int, input_audio_ms: float, output_audio_ms: float
) -> ev.Usage:
    audio_in = audio_tokens(input_audio_ms, INPUT_AUDIO_TOKENS_PER_S)
    audio_out = audio_tokens(output_audio_ms, OUTPUT_AUDIO_TOKENS_PER_S)
    tokens_in, tokens_out = input_text + audio_in, output_text + audio_out
    return ev.Usage(
        total_tokens=tokens_in + tokens_out,
        input_tokens=tokens_in,
        output_tokens=tokens_out,
        input_token_details=ev.InputTokenDetails(text_tokens=input_text, audio_tokens=audio_in),
        output_token_details=ev.OutputTokenDetails(text_tokens=output_text, audio_tokens=audio_out),
        input_audio_seconds=round(input_audio_ms / 1000.0, 3),
        output_audio_seconds=round(output_audio_ms / 1000.0, 3),
    )


class UsageState(msgspec.Struct, frozen=True):
    """A :class:`UsageMeter`'s figures, as kept in the engine."""

    received_ms: float = 0.0
    appended_ms: float = 0.0
    committed_ms: float = 0.0
    responses: int = 0
    input: ev.InputTokenDetails = ev.InputTokenDetails()
    output: ev.OutputTokenDetails = ev.OutputTokenDetails()
    output_ms: float = 0.0


class UsageMeter:
    """One session's usage (the session core calls it; no clock, no I/O)."""

    def __init__(self) -> None:
        self.received_ms = 0.0  # all input audio the session received
        self._appended_ms = 0.0  # handed to the engine, not yet committed
        self._committed_ms = 0.0  # committed, not yet answered by a response
        self.responses = 0
        self._input = ev.InputTokenDetails()
        self._output = ev.OutputTokenDetails()
        self._output_ms = 0.0

    def received(self, ms: float) -> None:
        self.received_ms += ms

    def appended(self, ms: float) -> None:
        self._appended_ms += ms

    def committed(self) -> None:
        """The engine's input buffer was committed into the conversation."""
        self._committed_ms += self._appended_ms
        self._appended_ms = 0.0

    def cleared(self) -> None:
        """The engine's input buffer was dropped (``input_audio_buffer.clear``)."""
        self._appended_ms = 0.0

    def answered(self) -> float:
        """A response began: the committed audio it answers (ms), now accounted to it."""
        ms, self._committed_ms = self._committed_ms, 0.0
        return ms

    def add(self, usage: ev.Usage) -> None:
        """A response finished with ``usage``."""
        self.responses += 1
        i, o = usage.input_token_details, usage.output_token_details
        self._input = ev.InputTokenDetails(
            text_tokens=self._input.text_tokens + i.text_tokens,
            audio_tokens=self._input.audio_tokens + i.audio_tokens,
            cached_tokens=self._input.cached_tokens + i.cached_tokens,
        )
        self._output = ev.OutputTokenDetails(
            text_tokens=self._output.text_tokens + o.text_tokens,
            audio_tokens=self._output.audio_tokens + o.audio_tokens,
        )
        self._output_ms += usage.output_audio_seconds * 1000.0

    def snapshot(self) -> UsageState:
        return UsageState(
            self.received_ms,
            self._appended_ms,
            self._committed_ms,
            self.responses,
            self._input,
            self._output,
            self._output_ms,
        )

    def restore(self, state: UsageState) -> None:
        """Continue from ``state`` (a session taken over from another front end)."""
        self.received_ms = state.received_ms
        self._appended_ms = state.appended_ms
        self._committed_ms = state.committed_ms
        self.responses = state.responses
        self._input, self._output = state.input, state.output
        self._output_ms = state.output_ms

    def total(self) -> ev.SessionUsage:
        i, o = self._input, self._output
        tokens_in = i.text_tokens + i.audio_tokens
        tokens_out = o.text_tokens + o.audio_tokens
        return ev.SessionUsage(
            total_tokens=tokens_in + tokens_out,
            input_tokens=tokens_in,
            output_tokens=tokens_out,
            input_token_details=i,
            output_token_details=o,
            input_audio_seconds=round(self.received_ms / 1000.0, 3),
            output_audio_seconds=round(self._output_ms / 1000.0, 3),
            responses=self.responses,
        )
