"""A spoken reply ends after its sentence budget (engine.prompt.spoken_max_sentences): the
engine's own path, test stages. Its text and audio stop there, the LLM request is stopped
(the reply ends long before the LLM would have finished), and a text reply is not cut."""

from __future__ import annotations

import time

import msgspec
import pytest

from duplex_contract.control import AppendCall, CommitCall, OpenCall
from duplex_contract.session_events import AudioChunk, ResponseDone, TextDelta
from duplex_contract.settings import Modality, SessionSettings
from engine.config import PromptConfig
from tests.engine.conftest import UNIT, collect, make_config, open_engine, run, stages

pytestmark = pytest.mark.usefixtures("transport")  # both engine transports

SLOW = {"token_interval_s": 0.2}  # "Hello there. This is the deterministic test stage ..."


async def _reply(modalities: tuple[Modality, ...]) -> tuple[str, ResponseDone, float]:
    cfg = make_config()
    cfg = msgspec.structs.replace(cfg, prompt=PromptConfig(spoken_max_sentences=1))
    engine = await open_engine(cfg, stages(**SLOW))
    try:
        res = await engine.call(OpenCall(config=SessionSettings(output_modalities=modalities)))
        assert res.session_id and res.accepted_fence
        fence = res.accepted_fence
        await engine.call(AppendCall(fence=fence, lease_generation=1, text="hi"))
        start = time.monotonic()
        await engine.call(CommitCall(fence=fence, lease_generation=1))
        events = await collect(
            engine, res.session_id, lambda e: isinstance(e, ResponseDone), 20 * UNIT
        )
        took = time.monotonic() - start
        text = "".join(e.text for e in events if isinstance(e, TextDelta | AudioChunk))
        done = events[-1]
        assert isinstance(done, ResponseDone)
        return text, done, took
    finally:
        await engine.shutdown()


def test_a_spoken_reply_stops_after_its_first_sentence() -> None:
    text, done, took = run(_reply(("audio",)))
    assert text == "Hello there."
    assert done.status == "completed"
    assert took < 2.0 * UNIT  # the whole reply takes ~14 tokens x 0.2 s: stopped early
    # usage: the stopped request still says how long its prompt was ("hi" and the default
    # instructions: a word is a token to the test stage), and the tokens it made: the
    # sentence's and the next one's first ("This", which showed the sentence had ended)
    assert done.input_tokens == 1 + len(make_config().default_instructions.split())
    assert done.output_tokens == len(text.split()) + 1


def test_a_text_reply_is_not_cut() -> None:
    text, done, _ = run(_reply(("text",)))
    assert text.startswith("Hello there. This is") and done.status == "completed"
