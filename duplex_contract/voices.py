"""The voices a server speaks in: the engine's own names, and OpenAI's names as aliases.

The engine's speaking stage says which voices it has (``engine/voices.py``); the server
checks every voice a client names against them (``session.update`` ``audio.output.voice``,
``POST /v1/audio/speech`` ``voice``, chat ``audio.voice``) and lists them at
``GET /v1/voices``. OpenAI's voice names, which OpenAI clients send by default, are
accepted as aliases of the default voice unless the engine has a voice of that name itself
(the ``openai`` stage, which forwards them). Anything else is refused with the list.
"""

from __future__ import annotations

from dataclasses import dataclass

#: OpenAI's built-in voice names (Realtime and speech APIs)
OPENAI_VOICES: tuple[str, ...] = (
    "alloy",
    "ash",
    "ballad",
    "coral",
    "echo",
    "fable",
    "nova",
    "onyx",
    "sage",
    "shimmer",
    "verse",
    "marin",
    "cedar",
)


@dataclass(frozen=True, slots=True)
class VoiceCatalog:
    """``voices``: the engine's own voices, the default first; ``aliases``: other names
    accepted for the default voice."""

    voices: tuple[str, ...]
    aliases: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.voices:
            raise ValueError("a voice catalog needs at least one voice")

    @classmethod
    def with_openai_aliases(cls, voices: tuple[str, ...]) -> VoiceCatalog:
        """``voices`` plus OpenAI's names that are not among them, as aliases."""
        unique = tuple(dict.fromkeys(voices))
        return cls(unique, tuple(v for v in OPENAI_VOICES if v not in unique))

    @property
    def default(self) -> str:
        return self.voices[0]

    def resolve(self, name: str | None) -> str | None:
        """The engine voice for ``name`` (None: the engine's default); an alias is the
        default voice. ``name`` must have passed :meth:`problem`."""
        if name is None or name in self.voices:
            return name
        return self.default

    def problem(self, name: str) -> str | None:
        """None if ``name`` is a voice or an alias, else why not (with the voices)."""
        if name in self.voices or name in self.aliases:
            return None
        return f"unknown voice {name!r}; {self.describe()}"

    def describe(self) -> str:
        """``the voices are: a (default), b; aliases of a: alloy, ...``."""
        listed = ", ".join(f"{v} (default)" if i == 0 else v for i, v in enumerate(self.voices))
        text = f"the voices are: {listed}"
        if self.aliases:
            text += f"; aliases of {self.default}: {', '.join(self.aliases)}"
        return text
