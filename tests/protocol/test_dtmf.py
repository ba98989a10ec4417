"""Keypad digits in the session core (pure): reported always, a user text item with
``dtmf_as_text``, answered at once only when no speech or response is in the way."""

from __future__ import annotations

from duplex_server.protocol import events as ev
from duplex_server.protocol.commands import Append, Cancel, Commit
from duplex_server.protocol.dtmf import DtmfPlan, dtmf_text, plan
from duplex_server.protocol.vad_events import VadStart
from tests.protocol.test_session import CHUNK, calls, core, sent, start_response, types

NO_TD = ev.TurnDetection(interrupt_response=False)


def test_plan() -> None:
    c = core(dtmf_as_text=True).config
    assert plan(core().config, speaking=False, response_active=False) == DtmfPlan()
    assert plan(c, speaking=False, response_active=False) == DtmfPlan(True, False, True)
    assert plan(c, speaking=True, response_active=False) == DtmfPlan(True, False, False)
    assert plan(c, speaking=False, response_active=True) == DtmfPlan(True, True, True)
    quiet = core(dtmf_as_text=True, turn_detection=NO_TD).config
    assert plan(quiet, speaking=False, response_active=True) == DtmfPlan(True, False, False)
    manual = core(dtmf_as_text=True, turn_detection=None).config
    assert plan(manual, speaking=False, response_active=False) == DtmfPlan(True, False, False)


def test_a_digit_is_reported_and_without_dtmf_as_text_nothing_else() -> None:
    out = core().on_dtmf("5", 1_700_000_000, 0)
    assert sent(out) == [ev.DtmfEventReceived(event="5", received_at=1_700_000_000)]
    assert calls(out) == []


def test_a_digit_becomes_an_answered_user_item() -> None:
    c = core(dtmf_as_text=True)
    out = c.on_dtmf("1", 7, 0)
    assert types(out) == [
        "input_audio_buffer.dtmf_event_received",
        "conversation.item.added",
        "conversation.item.done",
    ]
    event = sent(out)[0]
    assert isinstance(event, ev.DtmfEventReceived) and event.item_id is not None
    append, commit = calls(out)
    assert append == Append(0, text=dtmf_text("1"), item_id=event.item_id)
    assert commit == Commit(0, respond=True)
    assert c.responses.active


def test_a_digit_interrupts_a_response_or_waits_for_the_speech_turn() -> None:
    c = core(dtmf_as_text=True)
    start_response(c)
    out = c.on_dtmf("2", 7, 10)
    assert "response.done" in types(out) and Cancel(0, "barge_in") in calls(out)
    assert calls(out)[-1] == Commit(1, respond=True)  # answered in the new epoch
    # while the user speaks, the digit joins the speech turn (committed with it)
    s = core(dtmf_as_text=True)
    s.on_input_audio(CHUNK, [VadStart(onset_ms=0.0, audio_start_ms=0.0)], 0)
    out = s.on_dtmf("3", 7, 10)
    assert [type(x) for x in calls(out)] == [Append] and not s.responses.active
