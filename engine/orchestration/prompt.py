"""The prompt around a conversation: language hint, spoken examples, history note (pure).

:func:`build_prompt` takes what :meth:`ConversationHistory.messages
<engine.orchestration.history.ConversationHistory.messages>` returns (the system message,
then the conversation) and shapes it by ``engine.prompt`` (:class:`~engine.config.PromptConfig`):

* ``language_hint``: the system message ends with "Always reply in English." (the session's
  transcription language, ``audio.input.transcription.language``). SmolLM2-135M answered
  "What is the capital of France?" in French and "What language is spoken in Spain?" in
  Spanish without it.
* ``spoken_examples`` (spoken replies only): example exchanges after the system message, as
  chat messages; they set the length and tone of an answer.
* ``history_note``: the turns before the newest user message become one note ("Earlier in this
  conversation: User: ... You: ...") at the end of the system message; with examples, the
  system message is repeated with the note after them. The newest user message and what
  follows it (tool results) stay chat messages. A 135M model given the earlier turns as chat
  messages repeated an earlier answer instead of answering (30 held-out questions in one
  conversation: 47-60% answered with chat history, 67-73% with the note, 70% with none).

The order keeps what does not change in front (system message, examples) and the note growing
at its end, so llama.cpp re-evaluates only the new part of each prompt (its KV cache keeps the
longest common prefix): a note inside the first system message, before the examples, made
every turn re-evaluate ~250 tokens (~2 s of CPU on this machine's shared cores).

A spoken reply is also ended after ``spoken_max_sentences`` sentences, by the pipeline
(:class:`~engine.pipeline.segmenter.SentenceStop`), not by the prompt.
"""

from __future__ import annotations

from duplex_contract.batch import ChatMessage
from engine.config import PromptConfig

__all__ = ["build_prompt", "language_name"]

#: names of the languages a session most often asks for; others are named by their code
_NAMES = {
    "en": "English",
    "fr": "French",
    "de": "German",
    "es": "Spanish",
    "it": "Italian",
    "pt": "Portuguese",
    "nl": "Dutch",
    "pl": "Polish",
    "ru": "Russian",
    "uk": "Ukrainian",
    "tr": "Turkish",
    "ar": "Arabic",
    "he": "Hebrew",
    "hi": "Hindi",
    "zh": "Chinese",
    "ja": "Japanese",
    "ko": "Korean",
    "sv": "Swedish",
    "da": "Danish",
    "no": "Norwegian",
    "fi": "Finnish",
    "cs": "Czech",
    "el": "Greek",
    "ro": "Romanian",
    "hu": "Hungarian",
    "vi": "Vietnamese",
    "id": "Indonesian",
    "th": "Thai",
}


def language_name(code: str) -> str:
    """The English name of an ISO-639-1 code ("the language with code xx" if unlisted)."""
    return _NAMES.get(code, f"the language with ISO 639-1 code {code}")


def build_prompt(
    messages: tuple[ChatMessage, ...],
    config: PromptConfig,
    *,
    spoken: bool,
    language: str,
) -> tuple[ChatMessage, ...]:
    """``messages`` (a system message, then the conversation) shaped by ``config``."""
    if not messages or messages[0].role != "system":
        raise ValueError("the prompt starts with its system message")
    system = messages[0].content
    if config.language_hint:
        system = f"{system}\nAlways reply in {language_name(language)}."
    turns = messages[1:]
    note = ""
    if config.history_note:
        last_user = max((i for i, m in enumerate(turns) if m.role == "user"), default=-1)
        if last_user > 0:
            note = "\nEarlier in this conversation: "
            note += " ".join(_note_line(m) for m in turns[:last_user])
            turns = turns[last_user:]
    examples: list[ChatMessage] = []
    if spoken:
        for user, assistant in config.spoken_examples:
            examples.append(ChatMessage(role="user", content=user))
            examples.append(ChatMessage(role="assistant", content=assistant))
    if not examples:
        return (ChatMessage(role="system", content=system + note), *turns)
    head = (ChatMessage(role="system", content=system), *examples)
    if note:  # the system message again, with the note: after the examples (see above)
        head = (*head, ChatMessage(role="system", content=system + note))
    return (*head, *turns)


def _note_line(message: ChatMessage) -> str:
    who = {"user": "User", "assistant": "You"}.get(message.role, "Note")
    return f"{who}: {message.content}"
