"""The calls on an open session that neither add input nor cancel: a touch (heartbeat,
detach, a playback mark) and the signals ``input.pause``, ``input.resume``,
``input.discard``, ``item.delete`` and ``session.update``. Pure functions of the session
(and the :class:`Effects` they add to)."""

from __future__ import annotations

import logging

from duplex_contract.control import ControlResult, SignalCall, TouchCall
from duplex_contract.errors import ControlError
from duplex_contract.tools import ItemRef
from engine.duplex.effects import Effects
from engine.duplex.session import DuplexSession

log = logging.getLogger(__name__)


def touch(session: DuplexSession, call: TouchCall, control_id: int, now: float) -> ControlResult:
    """Lease activity; ``playback_ack`` keeps what the client played of a response (and
    cuts the assistant turn to it when it is no longer running, or when asked to)."""
    if call.activity == "detach":
        session.lease.detach(now)
    elif call.activity == "playback_ack":
        mark = call.playback
        if mark is None:
            raise ControlError(
                "playback_ack needs playback{turn_id, response_seq, played_ms}",
                code="invalid_argument",
            )
        if mark.played_ms < 0:
            raise ControlError("played_ms must be >= 0", code="invalid_argument")
        key = (mark.turn_id, mark.response_seq)
        active = session.active
        running = active is not None and (active.fence.turn_id, active.fence.response_seq) == key
        if running:  # only the running response's mark is needed (a barge-in cuts it)
            session.played.clear()
            session.played[key] = mark.played_ms
        if mark.truncate or not running:
            try:
                clamped = session.history.truncate(mark.turn_id, mark.response_seq, mark.played_ms)
            except KeyError:
                raise ControlError(f"no assistant turn {key}", code="invalid_argument") from None
            return session.ok(control_id, clamped_ms=clamped)
        return session.ok(control_id, clamped_ms=mark.played_ms)
    return session.ok(control_id)


def signal(
    session: DuplexSession, call: SignalCall, control_id: int, effects: Effects
) -> ControlResult:
    """A signal that does not cancel."""
    if call.event == "input.pause":
        session.guess_words = call.words
        if session.audio:
            effects.speculate.append((session.fence, bytes(session.audio), call.respond))
        return session.ok(control_id)
    if call.event == "input.resume":
        session.guess_words = None
        effects.unspeculate.append(session.session_id)
        return session.ok(control_id)
    if call.event == "input.discard":  # text items and tool outputs stay
        session.audio.clear()
        session.audio_stream_ms = None
        session.guess_words = None
        effects.input_reset.append(session.session_id)  # its live partials are stale
        effects.unspeculate.append(session.session_id)
        return session.ok(control_id)
    if call.event == "item.delete":
        if call.item is None:
            raise ControlError("item.delete needs item", code="invalid_argument")
        delete_item(session, call.item)
        return session.ok(control_id)
    upd = call.update
    if upd is None:
        raise ControlError("session.update needs update", code="invalid_argument")
    session.config = upd.apply(session.config)
    return session.ok(control_id)


def delete_item(session: DuplexSession, ref: ItemRef) -> None:
    """Drop an item from the input or the history; the next prompt no longer has it.

    A turn queued or still transcribing that took the item drops it too; words already
    in a prompt being answered stay in that one answer only."""
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
