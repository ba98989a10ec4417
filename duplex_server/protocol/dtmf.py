"""Keypad digits (DTMF) from a phone transport (pure): what a digit does to the session.

A Twilio ``dtmf`` message (docs/protocol.md §12.2) reaches the session core as one digit.
It is always reported as ``input_audio_buffer.dtmf_event_received`` (OpenAI's name and
shape for keypad presses on its SIP calls, plus ``item_id``). With the session extension
``audio.input.dtmf_as_text: true`` the digit also becomes a user text item
(:func:`dtmf_text`) that the model reads like words, and :func:`plan` says whether it is
answered at once:

* while the user speaks: no; it is committed with that speech turn;
* without a response per turn (``turn_detection`` off, ``create_response: false``,
  transcription sessions): no; the next commit takes it;
* while a response runs or is pending: with ``interrupt_response`` the digit interrupts it
  (as a barge-in) and is answered; without, it waits for the next turn;
* else: it is committed and answered, as a finished speech turn is.
"""

from __future__ import annotations

from dataclasses import dataclass

from duplex_server.protocol.session_config import EffectiveSession

#: the keys of a telephone keypad (RFC 4733 events 0-15)
DIGITS = frozenset("0123456789*#ABCD")


def dtmf_text(digit: str) -> str:
    """The user text item of a digit (what the model reads)."""
    return f"I pressed {digit} on the phone keypad."


@dataclass(frozen=True, slots=True)
class DtmfPlan:
    as_item: bool = False  # the digit becomes a user text item
    interrupt: bool = False  # ... that interrupts the response in progress
    respond: bool = False  # ... and is committed and answered now


def plan(config: EffectiveSession, *, speaking: bool, response_active: bool) -> DtmfPlan:
    if not config.dtmf_as_text:
        return DtmfPlan()
    if speaking or not config.create_response:
        return DtmfPlan(as_item=True)
    if response_active:
        td = config.turn_detection
        interrupt = td is not None and td.interrupt_response
        return DtmfPlan(as_item=True, interrupt=interrupt, respond=interrupt)
    return DtmfPlan(as_item=True, respond=True)
