"""The batch jobs a front end asks the engine for, and the items they stream back.

A batch HTTP route builds one :data:`BatchJob` (speech, chat, transcription); the engine
streams :data:`BatchItem`s for it and ends with :class:`BatchDone`. The text, audio and
transcript items are the engine stages' own outputs, streamed as they are made, so the
stages produce these structs too (the other stage messages stay in ``engine/messages.py``).
"""

from __future__ import annotations

from typing import Literal

import msgspec

from duplex_contract.audio import INPUT_RATE, OUTPUT_RATE
from duplex_contract.session_events import Msg
from duplex_contract.settings import Tool


class ChatMessage(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    role: Literal["system", "user", "assistant"]
    content: str


class TranscriptOut(Msg, frozen=True, tag="transcript"):
    request_id: str
    text: str
    final: bool


class TextOut(Msg, frozen=True, tag="text"):
    request_id: str
    text: str


class CallOut(Msg, frozen=True, tag="call_text"):
    """A piece of a function call the model writes (a chat job with ``tools``): the call's
    JSON ``{"name": ..., "arguments": {...}}`` as generated (duplex_contract/tools.py)."""

    request_id: str
    text: str


class AudioOut(Msg, frozen=True, tag="audio"):
    """A PCM16 mono chunk (~100 ms). ``t_ns`` = time.monotonic_ns() when the stage made it."""

    request_id: str
    pcm: bytes
    sample_rate: int
    t_ns: int = 0
    text: str = (
        ""  # optional mark: the characters this chunk speaks (else the orchestrator sets it)
    )


class SpeechJob(Msg, frozen=True, tag="speech"):
    text: str
    voice: str | None = None
    speed: float = 1.0
    sample_rate: int = OUTPUT_RATE


class ChatJob(Msg, frozen=True, tag="chat"):
    """A chat completion. With ``tools`` the model may answer with a function call instead
    of text (streamed as :class:`CallOut`; ``tool_required``: it must). ``route``: the
    engine route it runs on (None: ``voice`` when audio is asked for, else ``text``), e.g.
    a route with an LLM stage of its own (a GPT-Live session's delegation backend)."""

    messages: tuple[ChatMessage, ...]
    max_tokens: int = 256
    temperature: float = 0.0
    audio: bool = False
    voice: str | None = None
    sample_rate: int = OUTPUT_RATE
    tools: tuple[Tool, ...] = ()
    tool_required: bool = False
    route: str | None = None


class TranscribeJob(Msg, frozen=True, tag="transcribe"):
    audio: bytes  # PCM16 mono
    sample_rate: int = INPUT_RATE
    language: str = "en"
    #: the audio may be a listener's hum over an answer (the barge-in's words): an ASR
    #: that can tell writes a hum it took for words as "Mm-hmm." (Whisper)
    hums: bool = False


BatchJob = SpeechJob | ChatJob | TranscribeJob


class BatchDone(Msg, frozen=True, tag="batch_done"):
    request_id: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    audio_ms: float = 0.0
    finish_reason: str = "stop"


BatchItem = TextOut | CallOut | AudioOut | TranscriptOut | BatchDone
