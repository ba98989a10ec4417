"""SessionFacts (engine/orchestration/session_facts.py): a session's route, language and
input clock, with the defaults for a session that is gone."""

from __future__ import annotations

from engine.orchestration.session_facts import SessionFacts
from tests.engine.parts_fakes import session


def test_route_follows_the_output_modalities() -> None:
    voice, text = session("sess_v"), session("sess_t", output_modalities=("text",))
    facts = SessionFacts({"sess_v": voice, "sess_t": text})
    assert facts.route_of("sess_v") == "voice"
    assert facts.route_of("sess_t") == "text"
    assert facts.route_of("sess_gone") == "voice"


def test_language_and_input_clock() -> None:
    a = session("sess_a", language="de")
    a.audio_stream_ms = 1234.0
    facts = SessionFacts({"sess_a": a, "sess_b": session("sess_b")})
    assert facts.language_of("sess_a") == "de" and facts.language_of("sess_b") == "en"
    assert facts.language_of("sess_gone") == "en"
    assert facts.stream_of("sess_a") == 1234.0
    assert facts.stream_of("sess_b") is None and facts.stream_of("sess_gone") is None
