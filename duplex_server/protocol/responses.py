"""The response lifecycle (pure): which response is in progress or requested, and the
Realtime events of one response.

:class:`Responses` tracks the response in progress and the requested ones not started yet;
the response tracker (:mod:`~duplex_server.protocol.response_tracker`) decides when one is
requested, cancelled or interrupted. The event
builders emit *what* is sent, in the order OpenAI's Realtime API uses: ``response.created``
-> output item / content part added -> deltas -> ``.done`` events -> ``response.done``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import msgspec

from duplex_contract.fence import Fence
from duplex_contract.session_events import AudioChunk
from duplex_contract.tools import ResponseOptions
from duplex_server.protocol import events as ev
from duplex_server.protocol.commands import Action, Send, SendAudio


@dataclass(slots=True)
class Response:
    id: str
    item_id: str
    fence: Fence
    started_ms: float
    audio: bool
    audio_ms: float = 0.0
    parts: list[str] = field(default_factory=list)
    #: tools may be called: the output item is announced with the first output, once it is
    #: known to be a message or a function call
    deferred: bool = False
    opened: bool = False  # the message item was announced
    oob: bool = False  # out of band (conversation "none"): not in the conversation
    metadata: dict[str, str] | None = None
    call: ev.FunctionCallItem | None = None  # the function call, once it began
    call_args: list[str] = field(default_factory=list)
    previous: str | None = None  # the item before this response's item
    input_audio_ms: float = 0.0  # the committed user audio it answers (usage)
    #: session moments (the core's clock, ms) and engine segments for ``response.timing``
    moments: dict[str, float] = field(default_factory=dict)
    engine_ms: dict[str, float] = field(default_factory=dict)


def timing_origin(resp: Response) -> float | None:
    """The moment a response's timeline counts from: the last voiced audio, else the commit."""
    m = resp.moments
    return m.get("last_voice", m.get("committed", m.get("response_created")))


def response_timing(resp: Response) -> ev.ResponseTiming | None:
    """The response's timeline (moments relative to :func:`timing_origin`) and segments."""
    m = resp.moments
    origin = timing_origin(resp)
    if origin is None:
        return None
    moments = {k: round(v - origin, 1) for k, v in m.items()}
    seg: dict[str, float] = {}

    def span(name: str, a: str, b: str) -> None:
        if a in m and b in m:
            seg[name] = round(m[b] - m[a], 1)

    span("silence_wait", "last_voice", "speech_stopped")
    span("asr", "speech_stopped" if "speech_stopped" in m else "committed", "transcript_ready")
    for key, name in (
        ("llm_first_token", "llm"),
        ("tts_first_audio", "tts"),
        ("speculative_ms", "speculative_lead"),
        ("draft_asr", "draft_asr"),
        ("draft_llm", "draft_llm"),
        ("draft_tts", "draft_tts"),
    ):
        if key in resp.engine_ms:
            seg[name] = round(resp.engine_ms[key], 1)
    span("send", "first_audio", "first_audio_sent")
    if "first_audio_sent" in m:
        seg["server_total"] = moments["first_audio_sent"]
    return ev.ResponseTiming(moments_ms=moments, segments_ms=seg)


@dataclass(frozen=True, slots=True)
class Requested:
    """A response.create (or VAD commit) that has not started yet."""

    options: ResponseOptions | None = None
    metadata: dict[str, str] | None = None


def started_events(resp: Response, modalities: list[ev.Modality]) -> list[Action]:
    created = ev.ResponseObj(
        id=resp.id,
        status="in_progress",
        output=[],
        output_modalities=modalities,
        epoch=resp.fence.epoch,
        metadata=resp.metadata,
        conversation_id=None if resp.oob else "conv_default",
    )
    out: list[Action] = [Send(ev.ResponseCreated(response=created))]
    if not resp.deferred:
        out += message_events(resp)
    return out


def message_events(resp: Response) -> list[Action]:
    """The assistant message item of ``resp`` begins."""
    resp.opened = True
    part = (
        ev.ContentPart(type="output_audio", transcript="")
        if resp.audio
        else ev.ContentPart(type="output_text", text="")
    )
    item = ev.Item(id=resp.item_id, role="assistant", content=[], status="in_progress")
    out: list[Action] = [Send(ev.OutputItemAdded(response_id=resp.id, item=item))]
    if not resp.oob:
        out.append(Send(ev.ItemAdded(item=item, previous_item_id=resp.previous)))
    out.append(Send(ev.ContentPartAdded(response_id=resp.id, item_id=resp.item_id, part=part)))
    return out


def call_delta_events(resp: Response, call_id: str, name: str, delta: str) -> list[Action]:
    """A piece of a function call's arguments (the first one announces the call item)."""
    out: list[Action] = []
    if resp.call is None:
        resp.call = ev.FunctionCallItem(
            id=resp.item_id, call_id=call_id, name=name, arguments="", status="in_progress"
        )
        out.append(Send(ev.OutputItemAdded(response_id=resp.id, item=resp.call)))
        if not resp.oob:
            out.append(Send(ev.ItemAdded(item=resp.call, previous_item_id=resp.previous)))
    resp.call_args.append(delta)
    out.append(
        Send(
            ev.FunctionCallArgumentsDelta(
                response_id=resp.id, item_id=resp.item_id, call_id=call_id, delta=delta
            )
        )
    )
    return out


def call_done_events(resp: Response, call_id: str, name: str, arguments: str) -> list[Action]:
    """The call is complete: its arguments and the finished item."""
    out: list[Action] = []
    if resp.call is None:
        out += call_delta_events(resp, call_id, name, arguments)
    item = ev.FunctionCallItem(id=resp.item_id, call_id=call_id, name=name, arguments=arguments)
    resp.call = item
    out += [
        Send(
            ev.FunctionCallArgumentsDone(
                response_id=resp.id,
                item_id=resp.item_id,
                call_id=call_id,
                name=name,
                arguments=arguments,
            )
        ),
        Send(ev.OutputItemDone(response_id=resp.id, item=item)),
    ]
    if not resp.oob:
        out.append(Send(ev.ItemDone(item=item, previous_item_id=resp.previous)))
    return out


def audio_events(resp: Response, chunk: AudioChunk) -> tuple[SendAudio, Send]:
    """One piece of reply audio (``response.output_audio.delta`` once the runtime encoded
    it) and the transcript delta of the text it speaks (its mark)."""
    resp.audio_ms = chunk.audio_start_ms + chunk.duration_ms  # the engine's own duration
    resp.parts.append(chunk.text)
    audio = SendAudio(
        response_id=resp.id,
        item_id=resp.item_id,
        epoch=chunk.fence.epoch,
        pcm=chunk.pcm,
        sample_rate=chunk.sample_rate,
        audio_start_ms=chunk.audio_start_ms,
        duration_ms=chunk.duration_ms,
    )
    delta = ev.TranscriptDelta(response_id=resp.id, item_id=resp.item_id, delta=chunk.text)
    return audio, Send(delta)


def finished_events(
    resp: Response,
    status: str,
    reason: str | None,
    error: ev.ErrorDetail | None,
    usage: ev.Usage,
    modalities: list[ev.Modality],
) -> tuple[ev.AnyItem | None, list[Action]]:
    """The finished output item (None: there was none) and the events that close the
    response."""
    details = None
    if status != "completed":
        details = ev.StatusDetails(type=status, reason=reason, error=error)  # type: ignore[arg-type]
    if not resp.opened:  # a function call, or nothing at all
        call = resp.call
        out: list[Action] = []
        if call is not None and call.status != "completed":  # cut off mid-call
            call = msgspec.structs.replace(
                call, arguments="".join(resp.call_args), status="incomplete"
            )
            out.append(Send(ev.OutputItemDone(response_id=resp.id, item=call)))
            if not resp.oob:
                out.append(Send(ev.ItemDone(item=call, previous_item_id=resp.previous)))
        done = ev.ResponseObj(
            id=resp.id,
            status=status,  # type: ignore[arg-type]
            output=[] if call is None else [call],
            output_modalities=modalities,
            status_details=details,
            usage=usage,
            metadata=resp.metadata,
            conversation_id=None if resp.oob else "conv_default",
            epoch=resp.fence.epoch,
        )
        out.append(Send(ev.ResponseDone(response=done)))
        return call, out
    text = "".join(resp.parts)
    if resp.audio:
        part = ev.ContentPart(type="output_audio", transcript=text)
    else:
        part = ev.ContentPart(type="output_text", text=text)
    item_status = "completed" if status == "completed" else "incomplete"
    item = ev.Item(id=resp.item_id, role="assistant", content=[part], status=item_status)  # type: ignore[arg-type]
    rid, iid = resp.id, resp.item_id
    out = []
    if resp.audio:
        out += [
            Send(ev.AudioDone(response_id=rid, item_id=iid)),
            Send(ev.TranscriptDone(response_id=rid, item_id=iid, transcript=text)),
        ]
    else:
        out.append(Send(ev.TextDone(response_id=rid, item_id=iid, text=text)))
    done = ev.ResponseObj(
        id=rid,
        status=status,  # type: ignore[arg-type]
        output=[item],
        output_modalities=modalities,
        status_details=details,
        usage=usage,
        metadata=resp.metadata,
        conversation_id=None if resp.oob else "conv_default",
        epoch=resp.fence.epoch,
        audio_ms=resp.audio_ms,
        timing=response_timing(resp),
    )
    out += [
        Send(ev.ContentPartDone(response_id=rid, item_id=iid, part=part)),
        Send(ev.OutputItemDone(response_id=rid, item=item)),
    ]
    if not resp.oob:
        out.append(Send(ev.ItemDone(item=item)))
    out.append(Send(ev.ResponseDone(response=done)))
    return item, out


class Responses:
    """The response in progress (``current``) and the requested ones not started (``pending``)."""

    def __init__(self) -> None:
        self.current: Response | None = None
        self.queue: deque[Requested] = deque()  # requested responses not started yet
        #: the latest response started, kept after it ends: (id, started_ms)
        self.last_started: tuple[str, float] | None = None

    @property
    def pending(self) -> int:
        return len(self.queue)

    @property
    def active(self) -> bool:
        return self.current is not None or bool(self.queue)

    @property
    def started_ms(self) -> float | None:
        return None if self.current is None else self.current.started_ms

    def requested(self, request: Requested | None = None) -> None:
        self.queue.append(request or Requested())

    def request_failed(self) -> None:
        if self.queue:
            self.queue.pop()

    def next_request(self) -> Requested:
        """What the next response to start was requested with (it starts now)."""
        return self.queue.popleft() if self.queue else Requested()

    def started(self, resp: Response) -> None:
        """``resp`` started (the caller finished any previous one first)."""
        self.current = resp
        self.last_started = (resp.id, resp.started_ms)

    def cancelled(self) -> Response | None:
        """Every requested response is dropped; returns the one in progress, if any."""
        self.queue.clear()
        return self.current

    def ended(self) -> None:
        self.current = None

    def matching(self, fence: Fence) -> Response | None:
        """The response in progress if ``fence`` is its own."""
        resp = self.current
        return resp if resp is not None and resp.fence == fence else None
