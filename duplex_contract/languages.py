"""The transcription languages a session may ask for: Whisper's ISO-639-1 codes.

``audio.input.transcription.language`` is checked against :data:`LANGUAGES` (the two-letter
codes of Whisper's tokenizer, faster-whisper 1.2.1; ``jw`` is Whisper's own spelling of
Javanese, ISO ``jv``). A session that names none is transcribed as English
(:data:`DEFAULT_LANGUAGE`). tests/contract/test_languages.py keeps the list equal to the
installed tokenizer's.
"""

from __future__ import annotations

DEFAULT_LANGUAGE = "en"

#: the two-letter language codes Whisper transcribes
LANGUAGES: frozenset[str] = frozenset(
    "af am ar as az ba be bg bn bo br bs ca cs cy da de el en es et eu fa fi fo fr gl gu ha "
    "he hi hr ht hu hy id is it ja jw ka kk km kn ko la lb ln lo lt lv mg mi mk ml mn mr ms "
    "mt my ne nl nn no oc pa pl ps pt ro ru sa sd si sk sl sn so sq sr su sv sw ta te tg th "
    "tk tl tr tt uk ur uz vi yi yo zh".split()
)

#: the languages of the embedded CPU stack's English-only parts (pocketsphinx's en-us
#: partials model, SmolLM2, the Piper joe voice); Whisper-base is multilingual
ENGLISH_ONLY: frozenset[str] = frozenset({"en"})


def language_problem(code: str) -> str | None:
    """Why ``code`` is not a transcription language (None: it is one)."""
    if code in LANGUAGES:
        return None
    return (
        "must be an ISO-639-1 code that Whisper transcribes (one of "
        f"{', '.join(sorted(LANGUAGES))}); got {code!r}"
    )
