"""``audio.input.transcription.language``: parsed, validated and handed to the engine (pure:
the session core driven with decoded client frames)."""

from __future__ import annotations

import json

import pytest

from duplex_contract.languages import LANGUAGES
from duplex_server.protocol import events as ev
from duplex_server.protocol.codec import decode_client_event
from duplex_server.protocol.commands import Update
from duplex_server.protocol.errors import ProtocolError
from tests.protocol.test_session import calls, core, sent


def update(session: dict[str, object]) -> ev.AnyClientEvent:
    return decode_client_event(json.dumps({"type": "session.update", "session": session}))


def test_a_session_is_english_until_it_names_a_language() -> None:
    c = core()
    assert c.config.language == "en" and c.config.settings().language == "en"
    assert c.config.to_wire("s").audio.input.transcription == ev.TranscriptionOut(language="en")


@pytest.mark.parametrize(
    "session",
    [
        {"audio": {"input": {"transcription": {"model": "whisper-1", "language": "fr"}}}},
        {"input_audio_transcription": {"language": "FR"}},  # beta spelling, any case
    ],
)
def test_the_language_reaches_the_engine_settings(session: dict[str, object]) -> None:
    c = core()
    out = c.on_client_event(update(session), 0)
    assert c.config.language == "fr"
    (upd,) = [x for x in calls(out) if isinstance(x, Update)]
    assert upd.update.settings is not None and upd.update.settings.language == "fr"
    (updated,) = [e for e in sent(out) if isinstance(e, ev.SessionUpdated)]
    assert updated.session.audio.input.transcription == ev.TranscriptionOut(language="fr")


def test_ga_wins_and_null_goes_back_to_english() -> None:
    c = core()
    both = {
        "audio": {"input": {"transcription": {"language": "de"}}},
        "input_audio_transcription": {"language": "es"},
    }
    c.on_client_event(update(both), 0)
    assert c.config.language == "de"
    # a transcription object without a language leaves it; a null language resets it
    c.on_client_event(update({"audio": {"input": {"transcription": {"model": "x"}}}}), 0)
    assert c.config.language == "de"
    c.on_client_event(update({"audio": {"input": {"transcription": {"language": None}}}}), 0)
    assert c.config.language == "en"


@pytest.mark.parametrize(
    ("session", "param"),
    [
        ({"audio": {"input": {"transcription": {"language": "xx"}}}}, "audio.input"),
        ({"audio": {"input": {"transcription": {"language": "fra"}}}}, "audio.input"),
        ({"input_audio_transcription": {"language": "en-US"}}, "input_audio"),
    ],
)
def test_an_unknown_language_is_refused_naming_the_field(
    session: dict[str, object], param: str
) -> None:
    c = core()
    out = c.on_client_event(update(session), 0)
    (err,) = sent(out)
    assert isinstance(err, ev.Error) and err.error.code == "invalid_value"
    field = (
        "audio.input.transcription.language"
        if param == "audio.input"
        else "input_audio_transcription.language"
    )
    assert err.error.param == field
    assert err.error.message.startswith(f"{field} must be an ISO-639-1 code")
    assert "fr" in err.error.message and "zh" in err.error.message  # what is allowed
    assert c.config.language == "en" and not calls(out)  # nothing changed


def test_unknown_transcription_fields_are_refused() -> None:
    with pytest.raises(ProtocolError) as info:
        update({"audio": {"input": {"transcription": {"dialect": "fr"}}}})
    assert info.value.code == "invalid_event"
    assert info.value.param == "session.audio.input.transcription.dialect"


def test_every_listed_language_is_accepted() -> None:
    c = core()
    for code in sorted(LANGUAGES):
        c.on_client_event(update({"input_audio_transcription": {"language": code}}), 0)
        assert c.config.language == code
