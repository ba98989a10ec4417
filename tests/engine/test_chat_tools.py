"""Chat jobs with function tools and a route of their own (duplex_contract/batch.py,
engine/orchestration/batch_jobs.py): a call streams as ``CallOut`` pieces, never as text,
over both engine transports; a named route runs the job, a missing one fails it typed."""

from __future__ import annotations

import json

import pytest

from duplex_contract.batch import BatchDone, CallOut, ChatJob, ChatMessage, TextOut
from duplex_contract.errors import StageError
from duplex_contract.settings import Tool
from duplex_contract.tools import tool_result_note
from tests.engine.conftest import run, stages, start_engine

LOOKUP = Tool("lookup", "find an order", '{"type": "object"}')


def test_a_chat_job_with_tools_streams_its_call_and_then_answers(transport: str) -> None:
    async def main() -> None:
        opts = {"tool_calls": ["lookup"], "tool_arguments": {"lookup": '{"order": "A17"}'}}
        engine = await start_engine(stages(echo_prompt=True, **opts))
        try:
            ask = (ChatMessage("system", "You help."), ChatMessage("user", "where is A17?"))
            items = [i async for i in engine.generate(ChatJob(messages=ask, tools=(LOOKUP,)))]
            assert not [i for i in items if isinstance(i, TextOut)]
            call = json.loads("".join(i.text for i in items if isinstance(i, CallOut)))
            assert call == {"name": "lookup", "arguments": {"order": "A17"}}
            done = items[-1]
            assert isinstance(done, BatchDone) and done.finish_reason == "tool_calls"
            # the result as a system note: the next call answers with text
            note = tool_result_note("lookup", '{"order": "A17"}', "shipped")
            job = ChatJob(messages=(*ask, ChatMessage("system", note)), tools=(LOOKUP,))
            items = [i async for i in engine.generate(job)]
            text = "".join(i.text for i in items if isinstance(i, TextOut))
            assert "it returned shipped" in text and not any(isinstance(i, CallOut) for i in items)
            assert isinstance(items[-1], BatchDone) and items[-1].finish_reason == "stop"
        finally:
            await engine.shutdown()

    run(main())


def test_a_chat_job_runs_on_the_route_it_names() -> None:
    async def main() -> None:
        engine = await start_engine(stages(echo=True))
        try:
            ask = (ChatMessage("user", "repeat me"),)
            items = [i async for i in engine.generate(ChatJob(messages=ask, route="text"))]
            assert "".join(i.text for i in items if isinstance(i, TextOut)) == "repeat me"
            assert not any(type(i).__name__ == "AudioOut" for i in items)
            with pytest.raises(StageError) as info:
                async for _ in engine.generate(ChatJob(messages=ask, route="backend")):
                    pass
            assert info.value.code == "route_unavailable"
        finally:
            await engine.shutdown()

    run(main())
