"""DraftBook.take (engine/orchestration/draft_book.py): a commit adopts its session's draft
only when the draft answers the same plan; any other draft is discarded (counted, its stage
requests aborted)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from duplex_contract.tools import ResponseOptions
from engine.orchestration.counters import Counters
from engine.orchestration.draft_book import DraftBook
from engine.orchestration.drafts import Draft, response_plan
from engine.orchestration.stage_loads import WorkTally
from tests.engine.conftest import make_config
from tests.engine.parts_fakes import session

SID = "sess_a"


def _book() -> tuple[DraftBook, Counters, list[tuple[str, str]]]:
    counters, aborted = Counters(), []
    book = DraftBook(
        make_config(),
        SimpleNamespace(),  # type: ignore[arg-type]  # the pipeline: not used by take
        # the scheduler gets yield_drafts, and its tally hears how each draft ended
        SimpleNamespace(tally=WorkTally({})),  # type: ignore[arg-type]
        SimpleNamespace(),  # type: ignore[arg-type]
        {SID: session(SID)},
        counters,
        route_of=lambda sid: "voice",
        abort=lambda sid, prefix: aborted.append((sid, prefix)),
        track=lambda task: None,
    )
    return book, counters, aborted


def _draft(book: DraftBook, **opts: Any) -> Draft:
    draft = Draft(SID, 0, f"{SID}/e0/draft0")
    draft.plan = response_plan(make_config(), session(SID), ResponseOptions(**opts))
    book.drafts[SID] = draft
    return draft


def test_a_draft_of_the_same_plan_is_taken() -> None:
    book, counters, aborted = _book()
    draft = _draft(book)
    plan = response_plan(make_config(), session(SID), ResponseOptions())
    assert book.take(SID, plan, f"{SID}/e0/t1r1") is draft
    assert SID not in book.drafts and counters.drafts["dropped"] == 0 and aborted == []


def test_a_draft_of_another_plan_or_not_started_is_discarded() -> None:
    book, counters, aborted = _book()
    _draft(book, temperature=0.7)
    plan = response_plan(make_config(), session(SID), ResponseOptions())
    assert book.take(SID, plan, f"{SID}/e0/t1r1") is None
    book.drafts[SID] = Draft(SID, 0, f"{SID}/e0/draft1")  # no plan yet: not started
    assert book.take(SID, plan, f"{SID}/e0/t1r1") is None
    assert counters.drafts["dropped"] == 2 and SID not in book.drafts
    assert aborted == [(SID, f"{SID}/e0/draft0/"), (SID, f"{SID}/e0/draft1/")]
    assert book.take(SID, plan, f"{SID}/e0/t1r1") is None  # none left
