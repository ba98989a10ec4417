"""The interruption rule alone (protocol/interruption.py): how words are read, the modes,
and every verdict of ``confirm``; and its settings on the wire (turn_detection)."""

from __future__ import annotations

import pytest

from duplex_server.protocol import events as ev
from duplex_server.protocol.errors import ProtocolError
from duplex_server.protocol.input import should_interrupt
from duplex_server.protocol.interruption import (
    DEFAULT_BACKCHANNELS,
    Rule,
    Speech,
    decide,
    heard,
    lexicon,
    words_of,
)
from duplex_server.protocol.session_config import EffectiveSession, apply_patch

BC = lexicon(None)


def test_words_are_read_lower_cased_with_hyphens_as_spaces() -> None:
    assert words_of("Mm-hmm. Yeah!") == ("mm", "hmm", "yeah")
    assert words_of("I'm here") == ("i'm", "here")


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("", "none"),
        ("m h m", "none"),  # pocketsphinx spelling a hum
        ("the", "none"),  # a recogniser's guess at a hum
        ("and i'm a", "none"),
        ("M M them", "none"),  # Whisper, an espeak "Mm-hmm." over a WebRTC call
        ("M.M.H.N.", "none"),  # Whisper spelling one
        ("MMACM", "none"),
        ("NMA.", "none"),
        ("OK.", "backchannel"),
        ("STOP", "none"),  # (capitals are letters: Whisper writes words as words)
        ("yeah", "backchannel"),
        ("Mm-hmm.", "backchannel"),
        ("uh-huh", "backchannel"),
        ("uh huh", "backchannel"),
        ("oh I see", "backchannel"),
        ("okay right", "backchannel"),
        ("yeah the", "backchannel"),
        ("wait", "words"),
        ("no stop", "words"),
        ("yeah but what about", "words"),
        ("hold on", "words"),
        ("where you", "words"),
    ],
)
def test_what_a_transcript_says(text: str, said: str) -> None:
    assert heard(text, BC) == said


def test_a_custom_backchannel_list_replaces_the_default() -> None:
    mine = lexicon(("go on", "ja"))
    assert heard("ja", mine) == "backchannel"
    assert heard("go on", mine) == "backchannel"
    assert heard("yeah", mine) == "words"
    assert "mm-hm" in DEFAULT_BACKCHANNELS


def _rule(mode: str = "confirm", **td: object) -> Rule:
    rule = Rule.of(ev.TurnDetection(interrupt_mode=mode, **td), server_playout=False)  # type: ignore[arg-type]
    assert rule is not None
    return rule


def test_auto_is_confirm_only_where_the_server_plays_the_answer() -> None:
    td = ev.TurnDetection()
    assert td.interrupt_mode == "auto"
    ws, media = Rule.of(td, server_playout=False), Rule.of(td, server_playout=True)
    assert ws is not None and ws.mode == "immediate"
    assert media is not None and media.mode == "confirm"
    pinned = Rule.of(ev.TurnDetection(interrupt_mode="immediate"), server_playout=True)
    assert pinned is not None and pinned.mode == "immediate"
    assert Rule.of(ev.TurnDetection(interrupt_response=False), server_playout=True) is None
    assert Rule.of(None, server_playout=True) is None


def test_immediate_is_the_old_guards_and_should_interrupt_is_that_rule() -> None:
    td = ev.TurnDetection(min_interrupt_speech_ms=300, uninterruptible_ms=1000)
    rule = _rule("immediate", min_interrupt_speech_ms=300, uninterruptible_ms=1000)
    for ms in (0, 299, 300, 900):
        for started, now in ((0.0, 500.0), (0.0, 1000.0), (None, 0.0)):
            want = decide(rule, Speech(ms), window_open=rule.window_open(started, now)) == "stop"
            got = should_interrupt(
                td, ms, response_active=True, response_started_ms=started, now_ms=now
            )
            assert got == want
    assert decide(rule, Speech(300), window_open=True) == "stop"
    assert decide(rule, Speech(299), window_open=True) == "go_on"
    # should_interrupt is the immediate rule even where the session asks for confirm
    confirm = ev.TurnDetection(interrupt_mode="confirm", min_interrupt_speech_ms=100)
    assert should_interrupt(confirm, 150, response_active=True, response_started_ms=None, now_ms=0)


def test_confirm_pauses_at_the_onset_and_not_inside_the_uninterruptible_window() -> None:
    rule = _rule()
    assert decide(rule, Speech(0.0), window_open=True) == "pause"
    assert decide(rule, Speech(0.0), window_open=False) == "go_on"
    # heard in the window, quiet when it opens: nothing; voiced again: the pause
    assert decide(rule, Speech(300.0, quiet=True), window_open=True) == "go_on"


def test_confirm_stops_long_speech_and_words_and_takes_back_the_rest() -> None:
    rule = _rule(confirm_window_ms=800, min_interrupt_speech_ms=120)

    def verdict(ms: float, quiet: bool, words: str = "") -> str:
        return decide(rule, Speech(ms, quiet, words, "paused"), window_open=True)

    assert verdict(500, quiet=False) == "go_on"  # still speaking, inside the window
    assert verdict(800, quiet=False) == "stop"  # as long as the window
    # quiet, waiting for its words, it is not speech: the window counts voice only
    assert verdict(900, quiet=True, words="yeah") == "resume"
    assert verdict(450, quiet=True) == "resume"  # no word: a cough, a hum
    assert verdict(450, quiet=True, words="yeah") == "resume"
    assert verdict(450, quiet=True, words="mm hmm okay") == "resume"
    assert verdict(450, quiet=True, words="wait") == "stop"
    assert verdict(100, quiet=True, words="wait") == "resume"  # under min_interrupt_speech_ms
    assert verdict(450, quiet=False, words="wait") == "go_on"  # words judged once it is quiet
    asked = Speech(450, True, "", "paused", asked_ms=1000.0)
    assert decide(rule, asked, window_open=True, now_ms=1500) == "go_on"  # its words come
    assert decide(rule, asked, window_open=True, now_ms=1600) == "resume"  # not in time


def test_a_speech_taken_back_is_stopped_by_late_words_and_paused_by_more_voice() -> None:
    rule = _rule(confirm_window_ms=800)

    def verdict(ms: float, quiet: bool, words: str = "") -> str:
        return decide(rule, Speech(ms, quiet, words, "taken_back"), window_open=True)

    assert verdict(600, quiet=True) == "go_on"
    assert verdict(1500, quiet=True) == "go_on"  # silence after it is not speech
    assert verdict(600, quiet=True, words="wait") == "stop"
    assert verdict(600, quiet=False) == "pause"
    # voiced again past the window: the next judgement stops it
    assert decide(rule, Speech(900, False, "", "paused"), window_open=True) == "stop"
    assert decide(rule, Speech(900, False, "", "stopped"), window_open=True) == "go_on"


def test_the_settings_on_the_wire() -> None:
    base = EffectiveSession()
    td = base.turn_detection
    assert td is not None
    assert (td.interrupt_mode, td.confirm_window_ms, td.backchannels) == ("auto", 800, None)
    patch = ev.SessionParam(
        turn_detection=ev.TurnDetectionParam(
            interrupt_mode="confirm", confirm_window_ms=600, backchannels=[" ja ", "go on"]
        )
    )
    new = apply_patch(base, patch).turn_detection
    assert new is not None
    assert (new.interrupt_mode, new.confirm_window_ms, new.backchannels) == (
        "confirm",
        600,
        ("ja", "go on"),
    )
    # a new kind of turn detection keeps how interruptions are judged
    semantic = apply_patch(
        apply_patch(base, patch),
        ev.SessionParam(turn_detection=ev.TurnDetectionParam(type="semantic_vad")),
    ).turn_detection
    assert semantic is not None and semantic.type == "semantic_vad"
    assert (semantic.interrupt_mode, semantic.confirm_window_ms) == ("confirm", 600)
    assert semantic.backchannels == ("ja", "go on")
    back = apply_patch(
        apply_patch(base, patch),
        ev.SessionParam(turn_detection=ev.TurnDetectionParam(backchannels=None)),
    ).turn_detection
    assert back is not None and back.backchannels is None  # the default list again


@pytest.mark.parametrize(
    ("param", "field"),
    [
        (ev.TurnDetectionParam(confirm_window_ms=-1), "turn_detection.confirm_window_ms"),
        (ev.TurnDetectionParam(backchannels=["ok", " "]), "turn_detection.backchannels.1"),
        (ev.TurnDetectionParam(backchannels=["x" * 65]), "turn_detection.backchannels.0"),
        (ev.TurnDetectionParam(backchannels=["ok"] * 201), "turn_detection.backchannels"),
    ],
)
def test_bad_settings_are_refused_naming_the_field(
    param: ev.TurnDetectionParam, field: str
) -> None:
    with pytest.raises(ProtocolError) as exc:
        apply_patch(EffectiveSession(), ev.SessionParam(turn_detection=param))
    assert exc.value.param == field


def test_an_unknown_mode_is_refused_by_the_decoder() -> None:
    from duplex_server.protocol.codec import decode_client_event

    bad = '{"type":"session.update","session":{"turn_detection":{"interrupt_mode":"later"}}}'
    with pytest.raises(ProtocolError):
        decode_client_event(bad)
