"""Realtime response events built from one response's state (pure).

The session core (``session.py``) decides *when* a response starts, streams and ends;
these functions build *what* is sent then, in the order OpenAI's Realtime API uses:
``response.created`` -> output item / content part added -> deltas -> ``.done`` events ->
``response.done``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from duplex_server.protocol import events as ev
from duplex_server.protocol.codec import encode_audio_b64
from duplex_server.protocol.commands import Action, Send
from engine.messages import AudioChunk, Fence


@dataclass(slots=True)
class Response:
    id: str
    item_id: str
    fence: Fence
    started_ms: float
    audio: bool
    audio_ms: float = 0.0
    parts: list[str] = field(default_factory=list)


def started_events(
    resp: Response, modalities: list[ev.Modality], previous: str | None
) -> list[Action]:
    part = (
        ev.ContentPart(type="output_audio", transcript="")
        if resp.audio
        else ev.ContentPart(type="output_text", text="")
    )
    item = ev.Item(id=resp.item_id, role="assistant", content=[], status="in_progress")
    created = ev.ResponseObj(
        id=resp.id,
        status="in_progress",
        output=[],
        output_modalities=modalities,
        epoch=resp.fence.epoch,
    )
    return [
        Send(ev.ResponseCreated(response=created)),
        Send(ev.OutputItemAdded(response_id=resp.id, item=item)),
        Send(ev.ItemAdded(item=item, previous_item_id=previous)),
        Send(ev.ContentPartAdded(response_id=resp.id, item_id=resp.item_id, part=part)),
    ]


def audio_events(resp: Response, chunk: AudioChunk, data: bytes) -> list[Action]:
    """One audio delta and the transcript delta of the text it speaks (its mark)."""
    resp.audio_ms = chunk.audio_start_ms + chunk.duration_ms
    resp.parts.append(chunk.text)
    return [
        Send(
            ev.AudioDelta(
                response_id=resp.id,
                item_id=resp.item_id,
                delta=encode_audio_b64(data),
                epoch=chunk.fence.epoch,
                audio_start_ms=chunk.audio_start_ms,
                duration_ms=chunk.duration_ms,
            )
        ),
        Send(ev.TranscriptDelta(response_id=resp.id, item_id=resp.item_id, delta=chunk.text)),
    ]


def finished_events(
    resp: Response,
    status: str,
    reason: str | None,
    error: ev.ErrorDetail | None,
    tokens: int,
    modalities: list[ev.Modality],
) -> tuple[ev.Item, list[Action]]:
    """The finished assistant item and the events that close the response."""
    text = "".join(resp.parts)
    if resp.audio:
        part = ev.ContentPart(type="output_audio", transcript=text)
    else:
        part = ev.ContentPart(type="output_text", text=text)
    item_status = "completed" if status == "completed" else "incomplete"
    item = ev.Item(id=resp.item_id, role="assistant", content=[part], status=item_status)  # type: ignore[arg-type]
    rid, iid = resp.id, resp.item_id
    out: list[Action] = []
    if resp.audio:
        out += [
            Send(ev.AudioDone(response_id=rid, item_id=iid)),
            Send(ev.TranscriptDone(response_id=rid, item_id=iid, transcript=text)),
        ]
    else:
        out.append(Send(ev.TextDone(response_id=rid, item_id=iid, text=text)))
    details = None
    if status != "completed":
        details = ev.StatusDetails(type=status, reason=reason, error=error)  # type: ignore[arg-type]
    done = ev.ResponseObj(
        id=rid,
        status=status,  # type: ignore[arg-type]
        output=[item],
        output_modalities=modalities,
        status_details=details,
        usage=ev.Usage(total_tokens=tokens, output_tokens=tokens),
        epoch=resp.fence.epoch,
        audio_ms=resp.audio_ms,
    )
    out += [
        Send(ev.ContentPartDone(response_id=rid, item_id=iid, part=part)),
        Send(ev.OutputItemDone(response_id=rid, item=item)),
        Send(ev.ItemDone(item=item)),
        Send(ev.ResponseDone(response=done)),
    ]
    return item, out
