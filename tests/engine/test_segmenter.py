"""Segmenter: pure tests, unit cases for typical LLM output plus Hypothesis properties."""

from __future__ import annotations

import itertools
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config import SegmenterConfig
from engine.pipeline.segmenter import Segmenter

CFG = SegmenterConfig()  # first_min_words=3, first_max_words=6, max_words=40


def run(chunks: list[str], cfg: SegmenterConfig = CFG) -> tuple[list[str], list[str]]:
    """Stream the chunks; return (segments from push, segments from flush)."""
    seg = Segmenter(cfg)
    pushed: list[str] = []
    for chunk in chunks:
        pushed.extend(seg.push(chunk))
    return pushed, seg.flush()


def segments(chunks: list[str], cfg: SegmenterConfig = CFG) -> list[str]:
    pushed, flushed = run(chunks, cfg)
    return pushed + flushed


def tokens_like_llm(text: str) -> list[str]:
    """Chunk like a BPE tokenizer: leading space attached to the word, punctuation alone."""
    return re.findall(r"\s*[A-Za-z']+|\s*\d+|\s*[^\sA-Za-z\d]|\s+", text)


# ----------------------------------------------------------------------------- unit cases
def test_first_segment_released_at_clause_once_min_words() -> None:
    text = "Sure, the capital of France is Paris, a city on the Seine. It is lovely."
    pushed, flushed = run(tokens_like_llm(text))
    # "Sure," has 1 word < first_min_words: no release there; the first segment is cut at six
    # words ("Sure, the capital of France is"), before the clause at "Paris,".
    assert pushed == ["Sure, the capital of France is ", "Paris, a city on the Seine. "]
    assert flushed == ["It is lovely."]


def test_first_segment_at_clause_boundary() -> None:
    # Clauses before the third word do not release the first segment.
    text = "Well, honestly, I think so. And more."
    assert segments(tokens_like_llm(text)) == ["Well, honestly, I think so. ", "And more."]
    text = "Good question; in short, the answer is no. Bye."
    assert segments(tokens_like_llm(text)) == [
        "Good question; in short, ",
        "the answer is no. ",
        "Bye.",
    ]
    text = "The three options are: red, green and blue."
    assert segments([text]) == ["The three options are: ", "red, green and blue."]


def test_first_segment_released_as_soon_as_next_word_starts() -> None:
    seg = Segmenter(CFG)
    assert seg.push("One two three four five six") == []  # "six" may still grow
    assert seg.push(" ") == []  # the whitespace run may still grow
    assert seg.push("s") == ["One two three four five six "]
    assert seg.pending == "s"
    assert seg.flush() == ["s"]


def test_sentence_end_needs_whitespace_after() -> None:
    seg = Segmenter(SegmenterConfig(first_min_words=1))
    assert seg.push("Hello world.") == []
    assert seg.push("5") == []  # "world.5": no boundary
    assert seg.push(" and more. Next") == ["Hello world.5 and more. "]


def test_numbers_and_abbreviations_not_split() -> None:
    text = (
        "Hello there my friend. It costs 3.5 dollars or 1,000 yen. Ask Dr. Smith, e.g. "
        "about the U.S. market, i.e. the big one. Call Mr. J. Doe at 5. Done!"
    )
    out = segments([text])
    assert out == [
        "Hello there my friend. ",
        "It costs 3.5 dollars or 1,000 yen. ",
        "Ask Dr. Smith, e.g. about the U.S. market, i.e. the big one. ",
        "Call Mr. J. Doe at 5. ",
        "Done!",
    ]


def test_later_segments_are_sentences_not_clauses() -> None:
    text = "Hi there friend, welcome. First, we mix; then, we bake: slowly! Is it done? Yes."
    assert segments(tokens_like_llm(text)) == [
        "Hi there friend, ",
        "welcome. ",
        "First, we mix; then, we bake: slowly! ",
        "Is it done? ",
        "Yes.",
    ]


def test_newline_is_a_boundary_and_list_markers_are_not() -> None:
    text = "Here are the steps:\n\n1. Preheat the oven\n2. Mix the flour\n\nEnjoy"
    assert segments(tokens_like_llm(text)) == [
        "Here are the steps:\n\n",
        "1. Preheat the oven\n",
        "2. Mix the flour\n\n",
        "Enjoy",
    ]


def test_whitespace_only_token_waits_for_next_word() -> None:
    seg = Segmenter(CFG)
    assert seg.push("This is the first line.") == []
    assert seg.push("\n\n") == []
    assert seg.push("Next") == ["This is the first line.\n\n"]


def test_quotes_and_markdown_after_punctuation() -> None:
    text = 'He said "stop right there now." Then **this part.** And (that one!) end'
    cfg = SegmenterConfig(first_max_words=10)
    assert segments([text], cfg) == [
        'He said "stop right there now." ',
        "Then **this part.** ",
        "And (that one!) ",
        "end",
    ]


def test_dash_is_a_clause_boundary_for_the_first_segment() -> None:
    assert segments(["Let me think \u2014 yes, that works."]) == [
        "Let me think \u2014 ",
        "yes, that works.",
    ]
    assert segments(["One two three - four five six seven"]) == [
        "One two three - ",
        "four five six seven",
    ]


def test_long_sentence_forced_at_max_words_prefers_late_clause() -> None:
    cfg = SegmenterConfig(first_min_words=1, first_max_words=2, max_words=10)
    words = " ".join(f"w{i}" for i in range(1, 26))
    out = segments([f"Ok. {words}."], cfg)
    assert out[0] == "Ok. "
    assert out[1] == " ".join(f"w{i}" for i in range(1, 11)) + " "
    assert out[2] == " ".join(f"w{i}" for i in range(11, 21)) + " "
    assert out[3] == " ".join(f"w{i}" for i in range(21, 26)) + "."
    # With a clause boundary in the second half, the forced cut happens there.
    text = "Ok. a b c d e f, g h i j k l m n."
    assert segments([text], cfg) == ["Ok. ", "a b c d e f, ", "g h i j k l m n."]
    # A clause boundary in the first half does not count: cut at max_words.
    text = "Ok. a b, c d e f g h i j k l m n."
    assert segments([text], cfg) == ["Ok. ", "a b, c d e f g h i j ", "k l m n."]


def test_leading_whitespace_joins_first_segment_and_flush_resets() -> None:
    seg = Segmenter(CFG)
    assert seg.push("  \n Hello there you, my friend") == ["  \n Hello there you, "]
    assert seg.flush() == ["my friend"]
    assert seg.flush() == []
    # After flush the next stream starts with a fresh first segment.
    assert seg.push("a b c d e f g") == ["a b c d e f "]
    seg.reset()
    assert seg.pending == ""
    assert seg.flush() == []


def test_empty_and_whitespace_only_inputs() -> None:
    assert segments([]) == []
    assert segments(["", ""]) == []
    assert segments([" ", "\n", " "]) == [" \n "]


def test_short_answer_comes_out_on_flush() -> None:
    assert run(["Yes", "."]) == ([], ["Yes."])
    assert run(["Paris is the capital."]) == ([], ["Paris is the capital."])


# ----------------------------------------------------------------------------- properties
WORDS = st.sampled_from(
    [
        "hello", "world", "3.5", "1,000", "e.g.", "i.e.", "Dr.", "Mr.", "U.S.", "J.", "2.",
        "end.", "stop!", "why?", "so,", "then;", "note:", "\u2014", "-", '"quoted."', "(aside)",
        "**bold.**", "x", "naïve", "3.", "...", "\u2026", "a", "Paris", "42", "0.25%",
    ]
)  # fmt: skip
SPACES = st.sampled_from([" ", " ", " ", "  ", "\n", "\n\n", "\t", " \n "])


@st.composite
def llm_texts(draw: st.DrawFn) -> str:
    words = draw(st.lists(WORDS, max_size=80))
    lead = draw(st.sampled_from(["", " ", "\n"]))
    parts = [lead]
    for word in words:
        parts.append(word)
        parts.append(draw(SPACES))
    if draw(st.booleans()) and len(parts) > 1:
        parts.pop()  # no trailing whitespace
    return "".join(parts)


@st.composite
def chunked(draw: st.DrawFn, texts: st.SearchStrategy[str]) -> tuple[str, list[str]]:
    text = draw(texts)
    cuts = sorted(draw(st.sets(st.integers(0, len(text)), max_size=len(text) + 1)))
    bounds = [0, *cuts, len(text)]
    return text, [text[a:b] for a, b in itertools.pairwise(bounds)]


CONFIGS = st.builds(
    SegmenterConfig,
    first_min_words=st.integers(1, 5),
    first_max_words=st.integers(1, 8),
    max_words=st.integers(1, 12),
)
ANY_TEXT = st.text(alphabet=st.characters(codec="utf-8"), max_size=200)
MIXED_TEXT = st.one_of(llm_texts(), ANY_TEXT)


@settings(max_examples=300)
@given(case=chunked(MIXED_TEXT), cfg=st.one_of(st.just(CFG), CONFIGS))
def test_concatenation_is_the_input(case: tuple[str, list[str]], cfg: SegmenterConfig) -> None:
    text, chunks = case
    out = segments(chunks, cfg)
    assert "".join(out) == text
    assert "" not in out
    if text.strip():
        assert all(s.strip() for s in out)
    else:
        assert out == ([text] if text else [])


@settings(max_examples=300)
@given(case=chunked(MIXED_TEXT), cfg=st.one_of(st.just(CFG), CONFIGS))
def test_streaming_equals_one_push(case: tuple[str, list[str]], cfg: SegmenterConfig) -> None:
    text, chunks = case
    assert segments(chunks, cfg) == segments([text], cfg)


@settings(max_examples=300)
@given(case=chunked(MIXED_TEXT), cfg=st.one_of(st.just(CFG), CONFIGS))
def test_never_splits_a_word(case: tuple[str, list[str]], cfg: SegmenterConfig) -> None:
    text, chunks = case
    pushed, flushed = run(chunks, cfg)
    pos = 0
    for seg in pushed:
        pos += len(seg)
        # A pushed segment ends in whitespace and the next word has already started: every
        # cut lies between a whitespace run and a non-whitespace run, so "3.5", "1,000",
        # "e.g." and any other word is always whole in one segment.
        assert seg[-1].isspace()
        assert pos < len(text) and not text[pos].isspace()
    assert len(flushed) <= 1


@settings(max_examples=300)
@given(case=chunked(llm_texts()), cfg=st.one_of(st.just(CFG), CONFIGS))
def test_segment_word_limits(case: tuple[str, list[str]], cfg: SegmenterConfig) -> None:
    text, chunks = case
    out = segments(chunks, cfg)
    if len(text.split()) > cfg.first_max_words:
        assert len(out[0].split()) <= cfg.first_max_words
    for seg in out[1:]:
        assert len(seg.split()) <= cfg.max_words


@pytest.mark.parametrize("number", ["3.5", "1,000", "0.25", "10.000,5", "v1.2.3", "3.14."])
@given(data=st.data())
def test_numbers_stay_whole(number: str, data: st.DataObject) -> None:
    text = f"We measured it at about {number} units. Then more, {number}\n{number}"
    _, chunks = data.draw(chunked(st.just(text)))
    out = segments(chunks)
    assert sum(s.count(number) for s in out) == 3


def test_text_known_whole_is_cut_into_sentences_only() -> None:
    """Batch speech (early_first=False): no early first clause, so no TTS pause in the
    middle of the first sentence."""
    from engine.config import SegmenterConfig
    from engine.pipeline.segmenter import Segmenter

    text = "Full duplex means both sides can talk at once. It is like a phone call."
    early = Segmenter(SegmenterConfig(first_min_words=2, first_max_words=4))
    assert early.push(text)[0] == "Full duplex means both "
    whole = Segmenter(SegmenterConfig(first_min_words=2, first_max_words=4), early_first=False)
    assert [*whole.push(text), *whole.flush()] == [
        "Full duplex means both sides can talk at once. ",
        "It is like a phone call.",
    ]
    whole.reset()
    assert whole.push("One. Two three four five six. ")[0] == "One. "  # still no early cut
