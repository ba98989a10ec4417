"""The answers bench's judge (bench/answers.py): keywords, English, length, loops."""

from __future__ import annotations

from bench.answers import MAX_WORDS, QUESTIONS, Question, has_keywords, is_english, judge, loops

PARIS = Question("What is the capital of France?", (("paris",),), "fact")
COUNT = Question("Count from one to five.", (("three", "3"), ("five", "5")), "instruction")


def test_a_short_english_answer_with_the_keyword_is_ok() -> None:
    v = judge("The capital of France is Paris.", PARIS)
    assert v.ok and v.keyword and v.english and not v.looped
    assert v.n_words == 6


def test_the_issue_s_answers_are_not_ok() -> None:
    french = "Le Grand Paris, le Grand-Bien-Étoile, la Marseur et la ville de Lyon."
    v = judge(french, PARIS)
    assert v.keyword and not v.english and not v.ok
    spanish = "El idioma que se habla en España es el español y es muy bonito."
    assert not is_english(spanish)
    assert not judge("The kangaroo.", Question("Which animal says moo?", (("cow",),), "f")).ok


def test_every_group_must_match_and_words_are_whole() -> None:
    assert judge("One, two, three, four, five.", COUNT).ok
    assert not judge("One, two, three.", COUNT).ok
    assert judge("1, 2, 3, 4, 5", COUNT).ok
    assert not has_keywords("Parisian food is good.", (("paris",),))
    assert has_keywords("There are twenty-four hours.", (("twenty four",),))
    assert has_keywords("I'm your assistant.", (("i'm",),))


def test_long_answers_and_loops_fail() -> None:
    long = " ".join(["Paris is lovely"] + [f"word{i}" for i in range(MAX_WORDS)])
    v = judge(long, PARIS)
    assert v.keyword and not v.short and not v.ok
    loop = "Fail again. Fail again. Fail again. Fail again."
    assert loops(loop)
    assert not loops("Fail again. Fail better.")
    assert judge("Paris, Paris, Paris.", PARIS).ok  # one word thrice is not a 3-word phrase
    assert not judge("", PARIS).ok


def test_english_is_the_benefit_of_the_doubt_for_bare_names() -> None:
    assert is_english("Paris.")
    assert is_english("Tokyo!")
    assert not is_english("Das ist nicht ein Haus und die Katze ist hier.")


def test_the_fixed_set_has_at_least_30_questions_with_keywords() -> None:
    assert len(QUESTIONS) >= 30
    assert len({q.text for q in QUESTIONS}) == len(QUESTIONS)
    assert all(q.keywords and all(g for g in q.keywords) for q in QUESTIONS)
    assert {q.kind for q in QUESTIONS} == {"fact", "smalltalk", "instruction"}
