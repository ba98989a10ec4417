"""ConversationHistory: pure tests of truncation, budget trimming and prompt shape."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from duplex_contract.batch import ChatMessage
from engine.orchestration.history import ConversationHistory

SYS = "You are terse."


def roles_and_texts(msgs: tuple[ChatMessage, ...]) -> list[tuple[str, str]]:
    return [(m.role, m.content) for m in msgs]


def spoken(
    h: ConversationHistory, turn: int, seq: int, chunks: list[str], ms: float = 100.0
) -> None:
    """Record a response whose audio chunks each last ``ms`` and speak one text chunk."""
    h.start_assistant(turn, seq)
    for i, text in enumerate(chunks):
        h.append_assistant(turn, seq, text, audio_start_ms=i * ms, duration_ms=ms)


# ----------------------------------------------------------------------------- truncation
def test_truncate_clamps_to_audio_produced() -> None:
    h = ConversationHistory(1000)
    spoken(h, 1, 1, ["Hello there. ", "How are you? "])
    assert h.produced_ms(1, 1) == 200.0
    assert h.truncate(1, 1, 5000.0) == 200.0
    assert h.assistant_text(1, 1) == "Hello there. How are you? "
    assert h.truncate(1, 1, -3.0) == 0.0
    assert h.assistant_text(1, 1) == ""
    assert h.truncate(1, 1, math.inf) == 200.0
    assert h.truncate(1, 1, -math.inf) == 0.0
    with pytest.raises(ValueError):
        h.truncate(1, 1, math.nan)


def test_truncate_keeps_fully_played_chunks_and_latest_call_wins() -> None:
    h = ConversationHistory(1000)
    spoken(h, 1, 1, ["One. ", "Two. ", "Three. "])
    assert h.truncate(1, 1, 200.0) == 200.0  # exactly the end of the second chunk
    assert h.assistant_text(1, 1) == "One. Two. "
    assert h.truncate(1, 1, 100.0) == 100.0
    assert h.assistant_text(1, 1) == "One. "
    assert h.truncate(1, 1, 300.0) == 300.0  # a later ack moves the cut forward again
    assert h.assistant_text(1, 1) == "One. Two. Three. "


def test_partially_played_chunk_is_cut_at_a_word_boundary() -> None:
    h = ConversationHistory(1000)
    h.start_assistant(2, 1)
    h.append_assistant(2, 1, "Sure. ", audio_start_ms=0.0, duration_ms=300.0)
    h.append_assistant(2, 1, "The capital is Paris. ", audio_start_ms=300.0, duration_ms=1000.0)
    h.append_assistant(2, 1, "Bye. ", audio_start_ms=1300.0, duration_ms=200.0)
    # 40% of 22 chars = 8.8 -> 8 chars = "The capi": the partial word "capi" is dropped.
    h.truncate(2, 1, 700.0)
    assert h.assistant_text(2, 1) == "Sure. The"
    # 50% = 11 chars = "The capital": ends exactly at a word end, so the word is kept.
    h.truncate(2, 1, 800.0)
    assert h.assistant_text(2, 1) == "Sure. The capital"
    # Less than the first word of the chunk: nothing of it.
    h.truncate(2, 1, 350.0)
    assert h.assistant_text(2, 1) == "Sure. "
    h.finish_assistant(2, 1, "cancelled")
    # the prompt marks the cut (a small model would take "Sure." for the whole answer)
    assert roles_and_texts(h.messages(SYS))[-1] == ("assistant", "Sure.... (interrupted)")


def test_text_mark_spans_following_chunks_without_text() -> None:
    h = ConversationHistory(1000)
    h.start_assistant(1, 1)
    h.append_assistant(1, 1, "Hello there friend. ", 0.0, 100.0)
    for i in range(1, 4):  # the TTS put the segment's text on its first chunk only
        h.append_assistant(1, 1, "", i * 100.0, 100.0)
    h.append_assistant(1, 1, "Next. ", 400.0, 100.0)
    assert h.produced_ms(1, 1) == 500.0
    h.truncate(1, 1, 250.0)  # 62.5% of "Hello there friend. " = 12 chars -> "Hello there "
    assert h.assistant_text(1, 1) == "Hello there "
    h.truncate(1, 1, 400.0)
    assert h.assistant_text(1, 1) == "Hello there friend. "


def test_text_only_response_is_not_cut_and_clamps_to_zero() -> None:
    h = ConversationHistory(1000)
    h.add_user("hi", 1)
    h.start_assistant(1, 1)
    h.append_assistant_text(1, 1, "Hello ")
    h.append_assistant_text(1, 1, "you.")
    assert h.truncate(1, 1, 900.0) == 0.0
    h.finish_assistant(1, 1, "completed")
    assert roles_and_texts(h.messages(SYS)) == [
        ("system", SYS),
        ("user", "hi"),
        ("assistant", "Hello you."),
    ]


def test_unknown_turns_and_misuse() -> None:
    h = ConversationHistory(100)
    with pytest.raises(KeyError):
        h.truncate(1, 1, 10.0)
    with pytest.raises(KeyError):
        h.append_assistant(1, 1, "x", 0.0, 10.0)
    with pytest.raises(KeyError):
        h.finish_assistant(1, 1, "completed")
    h.start_assistant(1, 1)
    with pytest.raises(KeyError):
        h.truncate(1, 2, 10.0)
    with pytest.raises(ValueError):
        h.start_assistant(1, 1)
    with pytest.raises(ValueError):
        h.append_assistant(1, 1, "x", 0.0, -1.0)
    h.finish_assistant(1, 1, "completed")
    with pytest.raises(ValueError):
        h.append_assistant(1, 1, "late", 0.0, 10.0)
    with pytest.raises(ValueError):
        ConversationHistory(0)


# ----------------------------------------------------------------------------- messages
def test_cancelled_before_audio_vanishes_and_users_merge() -> None:
    h = ConversationHistory(1000)
    h.add_user("What is the capital of France?", 1)
    spoken(h, 1, 1, ["Paris. "])
    h.finish_assistant(1, 1, "completed")
    h.add_user("And of Spain?", 2)
    h.start_assistant(2, 2)  # barge-in before any audio was heard
    h.finish_assistant(2, 2, "cancelled")
    h.add_user(" Sorry, I mean Italy. ", 3)
    spoken(h, 3, 3, ["Rome is ", "the capital. "])
    assert h.truncate(3, 3, 0.0) == 0.0  # barge-in: nothing of it was heard
    h.finish_assistant(3, 3, "cancelled")
    h.add_user("Italy?", 4)
    assert roles_and_texts(h.messages(SYS)) == [
        ("system", SYS),
        ("user", "What is the capital of France?"),
        ("assistant", "Paris."),
        ("user", "And of Spain?\nSorry, I mean Italy.\nItaly?"),
    ]


def test_budget_keeps_newest_and_starts_with_user() -> None:
    h = ConversationHistory(30)
    h.add_user("first question here", 1)  # 19
    spoken(h, 1, 1, ["first answer"])  # 12
    h.add_user("second one", 2)  # 10
    spoken(h, 2, 2, ["second answer"])  # 13
    h.add_user("third", 3)  # 5
    msgs = roles_and_texts(h.messages(SYS))
    # third(5) + second answer(13) + second one(10) = 28; first answer would make 40.
    assert msgs == [
        ("system", SYS),
        ("user", "second one"),
        ("assistant", "second answer"),
        ("user", "third"),
    ]
    h2 = ConversationHistory(20)
    h2.add_user("second one", 2)
    spoken(h2, 2, 2, ["second answer"])
    h2.add_user("third", 3)
    # The assistant message fits (18) but the user before it does not: it is dropped too.
    assert roles_and_texts(h2.messages(SYS)) == [("system", SYS), ("user", "third")]


def test_answer_in_progress_after_newest_user_is_kept_if_it_fits() -> None:
    h = ConversationHistory(30)
    h.add_user("old question", 1)
    h.add_user("tell me a joke", 2)
    spoken(h, 2, 2, ["Why did the chicken "])
    assert roles_and_texts(h.messages(SYS)) == [
        ("system", SYS),
        ("user", "old question\ntell me a joke"),
    ]
    h3 = ConversationHistory(40)
    h3.add_user("tell me a joke", 1)
    spoken(h3, 1, 1, ["Why did the chicken "])
    assert roles_and_texts(h3.messages(SYS))[-1] == ("assistant", "Why did the chicken")


def test_newest_user_alone_over_budget_keeps_its_tail_at_a_word() -> None:
    h = ConversationHistory(20)
    h.add_user("hello", 1)
    spoken(h, 1, 1, ["hi"])
    h.add_user("please summarise this rather long request for me", 2)
    msgs = roles_and_texts(h.messages(SYS))
    assert msgs == [("system", SYS), ("user", "long request for me")]
    h.add_user("x" * 50, 3)  # one huge word: cut by characters
    assert roles_and_texts(h.messages(SYS)) == [("system", SYS), ("user", "x" * 20)]


def test_old_turns_are_forgotten_but_prompt_is_unchanged() -> None:
    h = ConversationHistory(50)
    for turn in range(1, 200):
        h.add_user(f"question number {turn}", turn)
        spoken(h, turn, turn, [f"answer {turn}. "])
        h.finish_assistant(turn, turn, "completed")
    msgs = h.messages(SYS)
    assert sum(len(m.content) for m in msgs[1:]) <= 50
    assert msgs[-1].content == "answer 199."
    with pytest.raises(KeyError):
        h.truncate(1, 1, 10.0)  # long forgotten
    assert h.truncate(199, 199, 10.0) == 10.0
    assert len(h) < 20  # memory stays bounded


# ----------------------------------------------------------------------------- property
VOCAB = st.sampled_from(["hi", "the", "cat", "sat", "on", "a", "mat.", "3.5", "why?", "ok,"])
PHRASE = st.lists(VOCAB, min_size=0, max_size=12).map(" ".join)


@st.composite
def histories(draw: st.DrawFn) -> tuple[int, list[tuple[str, str]], ConversationHistory]:
    """Random histories plus their reference messages (stripped, empties dropped, merged)."""
    budget = draw(st.integers(1, 120))
    h = ConversationHistory(budget)
    ref: list[tuple[str, str]] = []
    for turn in range(1, draw(st.integers(0, 14)) + 1):
        user = draw(PHRASE)
        h.add_user(user, turn)
        ref.append(("user", user))
        if not draw(st.booleans()):
            continue
        chunks = draw(st.lists(PHRASE.map(lambda p: p + " "), max_size=5))
        if draw(st.booleans()):
            h.start_assistant(turn, 1)
            for chunk in chunks:
                h.append_assistant_text(turn, 1, chunk)
            heard = chunks
        else:
            spoken(h, turn, 1, chunks, ms=draw(st.sampled_from([20.0, 100.0, 0.1])))
            heard = chunks
            if draw(st.booleans()):
                played = draw(st.integers(0, len(chunks)))
                h.truncate(turn, 1, h.produced_ms(turn, 1) * played / max(len(chunks), 1))
                heard = chunks[:played]
        h.finish_assistant(turn, 1, draw(st.sampled_from(["completed", "cancelled"])))
        said = "".join(heard)
        if said.strip() and said.strip() != "".join(chunks).strip():  # cut: marked
            said = f"{said.strip()}... (interrupted)"
        ref.append(("assistant", said))
    merged: list[tuple[str, str]] = []
    for role, text in ref:
        text = text.strip()
        if not text:
            continue
        if merged and merged[-1][0] == role:
            merged[-1] = (role, merged[-1][1] + "\n" + text)
        else:
            merged.append((role, text))
    return budget, merged, h


@settings(max_examples=400)
@given(case=histories(), instructions=st.text(max_size=40))
def test_messages_fit_budget_and_are_the_newest(
    case: tuple[int, list[tuple[str, str]], ConversationHistory], instructions: str
) -> None:
    budget, ref, h = case
    out = roles_and_texts(h.messages(instructions))
    assert out[0] == ("system", instructions)
    body = out[1:]
    used = sum(len(text) for _, text in body)
    assert used <= budget
    assert all(text and text == text.strip() for _, text in body)
    assert all(a[0] != b[0] for a, b in itertools.pairwise(body))  # roles alternate
    users = [i for i, (role, _) in enumerate(ref) if role == "user"]
    if not users:
        assert body == ref[len(ref) - len(body) :]
        assert len(body) == len(ref) or used + len(ref[-len(body) - 1][1]) > budget
        return
    last = users[-1]
    newest = ref[last][1]
    assert body and body[0][0] == "user"
    # The newest user message is there, whole or as its tail.
    u = next(i for i in range(len(body) - 1, -1, -1) if body[i][0] == "user")
    assert newest.endswith(body[u][1])
    assert body[u][1] == newest or len(newest) > budget
    # Older messages are the contiguous run just before it; the answer after it is kept iff
    # it fits.
    older = body[:u]
    assert older == ref[last - len(older) : last]
    after = ref[last + 1 :]
    assert body[u + 1 :] == (
        after if after and len(body[u][1]) + len(after[0][1]) <= budget else []
    )
    # Maximal: the next older exchange (assistant + user) would not have fit.
    start = last - len(older)
    if start >= 2:
        assert used + len(ref[start - 1][1]) + len(ref[start - 2][1]) > budget
