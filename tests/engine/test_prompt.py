"""The prompt around a conversation (engine/orchestration/prompt.py), the sentence stop of a
spoken reply (engine/pipeline/segmenter.py) and a cut answer's mark in the history."""

from __future__ import annotations

import pytest

from duplex_contract.batch import ChatMessage
from engine.config import PromptConfig
from engine.orchestration.history import ConversationHistory
from engine.orchestration.prompt import build_prompt, language_name
from engine.pipeline.segmenter import SentenceStop
from engine.stages.llm_llamacpp import LoopGuard

EXAMPLES = (("Can you hear me?", "Yes."),)


def _conversation() -> tuple[ChatMessage, ...]:
    h = ConversationHistory(6000)
    h.add_user("What is the capital of France?", 1)
    h.start_assistant(1, 1)
    h.append_assistant_text(1, 1, "Paris.")
    h.finish_assistant(1, 1, "completed")
    h.add_user("And of Japan?", 2)
    return h.messages("Be brief.")


def test_language_hint_follows_the_session_language() -> None:
    cfg = PromptConfig(language_hint=True)
    en = build_prompt(_conversation(), cfg, spoken=True, language="en")
    assert en[0].content == "Be brief.\nAlways reply in English."
    de = build_prompt(_conversation(), cfg, spoken=True, language="de")
    assert de[0].content.endswith("Always reply in German.")
    assert language_name("xx") == "the language with ISO 639-1 code xx"
    off = build_prompt(_conversation(), PromptConfig(), spoken=True, language="en")
    assert off[0].content == "Be brief."  # the default: no hint


def test_examples_go_before_the_conversation_of_spoken_replies_only() -> None:
    cfg = PromptConfig(spoken_examples=EXAMPLES, language_hint=False)
    spoken = build_prompt(_conversation(), cfg, spoken=True, language="en")
    assert [(m.role, m.content) for m in spoken[:3]] == [
        ("system", "Be brief."),
        ("user", "Can you hear me?"),
        ("assistant", "Yes."),
    ]
    assert spoken[3:] == _conversation()[1:]
    text = build_prompt(_conversation(), cfg, spoken=False, language="en")
    assert text == _conversation()


def test_history_note_keeps_only_the_newest_question_as_a_message() -> None:
    note = "\nEarlier in this conversation: User: What is the capital of France? You: Paris."
    cfg = PromptConfig(history_note=True, language_hint=False, spoken_examples=EXAMPLES)
    out = build_prompt(_conversation(), cfg, spoken=True, language="en")
    # the stable part first (system, examples), the growing note after: a cached prefix
    assert [(m.role, m.content) for m in out] == [
        ("system", "Be brief."),
        ("user", "Can you hear me?"),
        ("assistant", "Yes."),
        ("system", "Be brief." + note),
        ("user", "And of Japan?"),
    ]
    text = build_prompt(_conversation(), cfg, spoken=False, language="en")  # no examples
    assert [(m.role, m.content) for m in text] == [
        ("system", "Be brief." + note),
        ("user", "And of Japan?"),
    ]
    first = build_prompt(
        (ChatMessage(role="system", content="S"), ChatMessage(role="user", content="Hi")),
        cfg,
        spoken=False,
        language="en",
    )
    assert first[0].content == "S" and first[1].content == "Hi"  # nothing earlier: no note
    with pytest.raises(ValueError):
        build_prompt((ChatMessage(role="user", content="Hi"),), cfg, spoken=True, language="en")


def _stream(stop: SentenceStop, deltas: list[str]) -> str:
    out = ""
    for d in deltas:
        out += stop.push(d)
        if stop.stopped:
            break
    return out + stop.flush()  # the end of the text


def test_sentence_stop_ends_after_the_nth_sentence_whatever_the_chunking() -> None:
    text = "Paris is the capital. It is in France. It has the Eiffel Tower."
    assert _stream(SentenceStop(2), [text]) == "Paris is the capital. It is in France."
    tokens = ["Paris", " is", " the", " capital", ".", " It", " is", " in", " France", ".", " It"]
    assert _stream(SentenceStop(2), tokens) == "Paris is the capital. It is in France."
    assert _stream(SentenceStop(1), tokens) == "Paris is the capital."
    assert _stream(SentenceStop(3), tokens) == "".join(tokens)  # not stopped yet
    # numbers and abbreviations are not sentence ends; a newline is
    assert _stream(SentenceStop(1), ["It is 3", ".", "5 km", " away. Yes."]) == "It is 3.5 km away."
    assert _stream(SentenceStop(1), ["Ask Dr. Smith now! Then go."]) == "Ask Dr. Smith now!"
    assert _stream(SentenceStop(1), ["Sure\n", "Here"]) == "Sure"
    stop = SentenceStop(1)
    assert _stream(stop, ["Hi. There."]) == "Hi." and stop.push("more") == ""
    with pytest.raises(ValueError):
        SentenceStop(0)
    # a word budget: a later sentence is spoken only if the answer stays within it
    long = "I can help with many things. Ask me about facts, jokes, words, numbers or anything."
    assert _stream(SentenceStop(2, words=8), [long]) == "I can help with many things."
    assert _stream(SentenceStop(2, words=20), [long]) == long
    tokens = [w + " " for w in long.split()]  # streamed: held, then dropped or passed on
    assert _stream(SentenceStop(2, words=8), tokens) == "I can help with many things."
    assert _stream(SentenceStop(2, words=20), tokens) == long
    first = "The first sentence is long enough to pass the budget on its own. Then more."
    assert _stream(SentenceStop(2, words=5), [first]) == first.split(" Then")[0]
    assert _stream(SentenceStop(3, words=3), ["Yes. I can. Go."]) == "Yes. I can."


def test_sentence_stop_takes_a_list_for_one_sentence() -> None:
    """ "Count from one to five" is not cut after "1. 1": the newline after a list item ends
    a sentence only where the list ends (the next line is not an item), whatever the
    chunking."""
    count = "1. One\n2. Two\n3. Three\n4. Four\n5. Five"
    for deltas in ([count], list(count), [w + " " for w in count.split(" ")]):
        text = "".join(deltas)
        assert _stream(SentenceStop(2), deltas) == text
    bullets = "Here you go:\n- milk\n- eggs\n- bread\nThat is all. Bye now."
    for deltas in ([bullets], list(bullets)):
        # the lead line, the list, then "That is all." makes three
        assert _stream(SentenceStop(2), deltas) == "Here you go:\n- milk\n- eggs\n- bread"
        assert _stream(SentenceStop(3), deltas) == bullets.split(" Bye")[0]
    # with a word budget the list is held as any later sentence, dropped if it runs past
    lead = "Sure.\n1. a\n2. b\n3. c\nDone."
    assert _stream(SentenceStop(3, words=20), [lead]) == lead
    assert _stream(SentenceStop(3, words=4), list(lead)) == "Sure."
    # a list that ends the text: flushed whole; a line after it that is cut off is not spoken
    assert _stream(SentenceStop(1), ["1. a\n2. b"]) == "1. a\n2. b"
    assert _stream(SentenceStop(1), ["1. a\n2. b\nAnd"]) == "1. a\n2. b"


def test_a_cut_answer_is_marked_in_the_prompt_only() -> None:
    h = ConversationHistory(6000)
    h.add_user("Sorry?", 1)
    h.start_assistant(1, 1)
    h.append_assistant(1, 1, "I'm sorry for any ", 0, 1000)
    h.append_assistant(1, 1, "confusion I caused.", 1000, 1000)
    h.finish_assistant(1, 1, "cancelled")
    h.truncate(1, 1, 1000)
    assert h.assistant_text(1, 1) == "I'm sorry for any "  # what was heard, unmarked
    assert h.messages("S")[-1].content == "I'm sorry for any... (interrupted)"
    h.truncate(1, 1, 2000)  # heard to the end after all: no mark
    assert h.messages("S")[-1].content == "I'm sorry for any confusion I caused."


def test_loop_guard_fires_on_the_third_time_round() -> None:
    guard = LoopGuard(3)
    fired = [guard.push(t) for t in [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3]]
    assert fired.index(True) == 10  # [1, 2, 3] for the third time
    once = LoopGuard(2)
    assert not any(once.push(t) for t in range(50))  # no repeats: never
    loop = LoopGuard(8)
    assert any(loop.push(7) for _ in range(10))  # one token over and over
