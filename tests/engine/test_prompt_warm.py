"""Warming the next prompt (engine/orchestration/prompt_warm.py) on a recording pipeline:
the request is the next prompt without the user's words, background priority, only for a
backend that keeps a prompt cache; a cut-short or failed warm-up says so."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import msgspec

from duplex_contract.batch import TextOut
from duplex_contract.errors import StageError
from duplex_contract.tools import ResponseOptions
from engine.config import EngineConfig, load_engine_config
from engine.duplex.session import DuplexSession
from engine.messages import LlmRequest, Priority, StageDone, StageRequest
from engine.orchestration.drafts import response_plan
from engine.orchestration.prompt_warm import warm_next_prompt, warms
from tests.engine.conftest import ROOT, make_config, run
from tests.engine.parts_fakes import session

SID = "sess_a"
PREFIX = f"{SID}/e0/t1/r1/warm"


def cpu_prompt_config() -> EngineConfig:
    """The test stages with the CPU default's prompt (examples, history note, hint)."""
    cpu = load_engine_config(ROOT / "configs" / "cpu.yaml")
    return msgspec.structs.replace(make_config(), prompt=cpu.prompt)


class Pool:
    """One replica (``warms_prompts`` as given); ``submit`` records and answers ``reason``."""

    def __init__(self, warms_prompts: bool | None, reason: str = "stop", fail: bool = False):
        replica = SimpleNamespace()
        if warms_prompts is not None:
            replica.warms_prompts = warms_prompts
        self.replicas = [replica]
        self.reason, self.fail = reason, fail
        self.requests: list[StageRequest] = []

    async def submit(self, request: StageRequest) -> AsyncIterator[Any]:
        self.requests.append(request)
        if self.fail:
            raise StageError("llm: replica down", code="stage_unavailable")
        yield TextOut(request_id=request.request_id, text="ignored")
        yield StageDone(request_id=request.request_id, finish_reason=self.reason)


class Slots:
    def __init__(self) -> None:
        self.held: list[str] = []

    @contextlib.asynccontextmanager
    async def slot(self, stage: str, request: StageRequest) -> AsyncIterator[Any]:
        self.held.append(stage)
        yield SimpleNamespace(output=lambda work: None)


class Pipeline:
    def __init__(self, pool: Pool) -> None:
        self.pools = {"llm": pool}
        self.slots = Slots()

    def route(self, name: str) -> Any:
        return SimpleNamespace(responder=SimpleNamespace(name="llm"))


def conversation() -> DuplexSession:
    s = session(SID)
    s.history.add_user("What is the capital of France?", 1)
    s.history.start_assistant(1, 1)
    s.history.append_assistant_text(1, 1, "Paris is the capital of France.")
    s.history.finish_assistant(1, 1, "completed")
    return s


def test_the_warm_up_is_the_next_prompt_without_the_users_words() -> None:
    config, s, pool = cpu_prompt_config(), conversation(), Pool(True)
    pipeline = Pipeline(pool)
    assert run(warm_next_prompt(pipeline, config, s, PREFIX)) is True  # type: ignore[arg-type]
    (req,) = pool.requests
    assert isinstance(req, LlmRequest) and req.prefill_only
    assert req.request_id == f"{PREFIX}/llm" and req.session_id == SID
    assert req.priority == Priority.SPECULATIVE  # behind every turn's and draft's work
    assert pipeline.slots.held == ["llm"]  # scheduled like any stage request
    # the next turn's prompt (a draft's, with the words its guess heard) starts with it
    nxt = response_plan(config, s, ResponseOptions(), pending_user="And Spain?").messages
    assert nxt[: len(req.messages)] == req.messages and len(nxt) == len(req.messages) + 1
    assert nxt[-1].role == "user" and nxt[-1].content == "And Spain?"
    assert "Paris is the capital" in req.messages[-1].content  # the note holds the last turn


def test_no_warm_up_where_the_backend_keeps_no_prompt_cache() -> None:
    config, s = cpu_prompt_config(), conversation()
    for pool in (Pool(None), Pool(False)):
        pipeline = Pipeline(pool)
        assert not warms(pipeline, "voice")  # type: ignore[arg-type]
        assert run(warm_next_prompt(pipeline, config, s, PREFIX)) is False  # type: ignore[arg-type]
        assert pool.requests == []


def test_a_warm_up_cut_short_or_failed_says_so() -> None:
    config, s = cpu_prompt_config(), conversation()
    cut, failed = Pool(True, reason="aborted"), Pool(True, fail=True)
    assert run(warm_next_prompt(Pipeline(cut), config, s, PREFIX)) is False  # type: ignore[arg-type]
    assert run(warm_next_prompt(Pipeline(failed), config, s, PREFIX)) is False  # type: ignore[arg-type]
    assert len(cut.requests) == len(failed.requests) == 1


def test_the_first_turn_warms_the_system_message_and_examples() -> None:
    config, s, pool = cpu_prompt_config(), session(SID), Pool(True)
    assert run(warm_next_prompt(Pipeline(pool), config, s, PREFIX)) is True  # type: ignore[arg-type]
    (req,) = pool.requests
    assert isinstance(req, LlmRequest)
    nxt = response_plan(config, s, ResponseOptions(), pending_user="Hello?").messages
    assert nxt[:-1] == req.messages and req.messages[0].role == "system"
