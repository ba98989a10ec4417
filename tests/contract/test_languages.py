"""The transcription languages the server accepts are exactly Whisper's two-letter codes."""

from __future__ import annotations

from faster_whisper.tokenizer import _LANGUAGE_CODES

from duplex_contract.languages import DEFAULT_LANGUAGE, LANGUAGES, language_problem


def test_languages_are_the_installed_whispers_two_letter_codes() -> None:
    assert frozenset(c for c in _LANGUAGE_CODES if len(c) == 2) == LANGUAGES
    assert DEFAULT_LANGUAGE in LANGUAGES


def test_language_problem_lists_what_is_allowed() -> None:
    assert language_problem("fr") is None
    problem = language_problem("klingon")
    assert problem is not None and "'klingon'" in problem and "af, am" in problem
