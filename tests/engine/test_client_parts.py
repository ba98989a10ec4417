"""The engine client's parts, each alone: the control-call waiters, the session and batch
mailboxes, the inbox that routes what the engine sends back, and the pushed figures."""

from __future__ import annotations

import asyncio

import pytest

from duplex_contract.batch import BatchDone
from duplex_contract.control import ControlResult
from duplex_contract.errors import EngineDeadError
from duplex_contract.fence import Fence
from duplex_contract.session_events import ErrorInfo, SessionLifecycle, TextDelta
from engine.api.client import EngineStats
from engine.api.inbox import EngineInbox
from engine.api.mailboxes import Mailboxes
from engine.api.remote_client import PushedFigures
from engine.api.remote_wire import StatsPush
from engine.api.waiters import CallWaiters
from engine.messages import BatchOutput, EngineFatal, SessionOutput

F = Fence("sess_a")


def _ok(cid: int) -> ControlResult:
    return ControlResult(control_id=cid, ok=True)


def test_waiters_resolve_their_own_call_and_count_late_replies() -> None:
    async def main() -> None:
        w = CallWaiters()
        (c1, f1), (c2, f2) = w.add(), w.add()
        assert c1 != c2 and len(w) == 2
        w.resolve(_ok(c2))
        assert (await f2).control_id == c2 and not f1.done()
        f1.cancel()  # its caller gave up (a timeout)
        await asyncio.sleep(0)
        assert len(w) == 0
        w.resolve(_ok(c1))
        assert w.late_replies == 1

    asyncio.run(main())


def test_waiters_all_fail_with_the_engines_death() -> None:
    async def main() -> None:
        w = CallWaiters()
        futs = [w.add()[1] for _ in range(3)]
        w.fail(EngineDeadError("gone"))
        for fut in futs:
            with pytest.raises(EngineDeadError):
                await fut
        assert len(w) == 0

    asyncio.run(main())


def _events(boxes: Mailboxes, sid: str) -> list[object]:
    async def read() -> list[object]:
        return [e async for e in boxes.session_events(sid)]

    return asyncio.run(asyncio.wait_for(read(), 1.0))


def test_a_sessions_events_wait_and_end_after_its_close() -> None:
    boxes = Mailboxes()
    delta = TextDelta(fence=F, text="hi")
    closed = SessionLifecycle(session_id="sess_a", state="closed")
    boxes.deliver(SessionOutput(session_id="sess_a", event=delta))
    boxes.deliver(SessionOutput(session_id="sess_a", event=closed))
    assert _events(boxes, "sess_a") == [delta, closed]


def test_death_ends_open_streams_with_the_error_but_not_a_closed_one() -> None:
    boxes = Mailboxes()
    boxes.open_session("sess_a")
    boxes.deliver(
        SessionOutput(session_id="sess_b", event=SessionLifecycle("sess_b", state="closed"))
    )
    boxes.end(EngineDeadError("gone"))
    with pytest.raises(EngineDeadError, match="gone"):
        _events(boxes, "sess_a")
    assert len(_events(boxes, "sess_b")) == 1  # it had closed: it just ends
    with pytest.raises(EngineDeadError):  # a mailbox made later ends at once too
        _events(boxes, "sess_new")


def test_batch_outputs_reach_their_job_and_death_ends_it() -> None:
    async def main() -> None:
        boxes = Mailboxes()
        boxes.open_batch("r1")
        done = BatchOutput(request_id="r1", item=BatchDone(request_id="r"))
        boxes.deliver(done)
        boxes.deliver(
            BatchOutput(request_id="r2", item=BatchDone(request_id="r"))
        )  # nobody waits: dropped
        assert await boxes.batch_output("r1") == done
        boxes.end(EngineDeadError("gone"))
        with pytest.raises(EngineDeadError):
            await boxes.batch_output("r1")
        assert boxes.close_batch("r1") and not boxes.close_batch("r1")

    asyncio.run(main())


def test_the_inbox_routes_results_events_and_a_fatal_error_once() -> None:
    async def main() -> None:
        inbox = EngineInbox()
        deaths: list[EngineDeadError] = []
        inbox.on_dead(deaths.append)
        cid, fut = inbox.waiters.add()
        inbox.receive(_ok(cid))
        assert (await fut).ok
        inbox.receive(SessionOutput(session_id="sess_a", event=TextDelta(fence=F, text="x")))
        _, pending = inbox.waiters.add()
        inbox.receive(EngineFatal(error=ErrorInfo.from_exc(EngineDeadError("boom"))))
        inbox.die(EngineDeadError("later"))  # the first death wins; hooks run once
        assert inbox.dead is not None and str(inbox.dead) == "boom" and len(deaths) == 1
        with pytest.raises(EngineDeadError, match="boom"):
            await pending
        events = inbox.mailboxes.session_events("sess_a")
        assert isinstance(await anext(events), TextDelta)
        with pytest.raises(EngineDeadError, match="boom"):
            await anext(events)

    asyncio.run(main())


def test_pushed_figures_keep_the_last_stats_and_drain_the_rest() -> None:
    figures = PushedFigures()
    with pytest.raises(Exception, match="no figures"):
        figures.stats()
    stats = EngineStats({"open": 1}, {}, 0, 0, 0, 0, {})
    figures.push(StatsPush(stats=stats, stage_latency=[("asr", 0.1)], stage_steps=[("llm", 2)]))
    figures.push(StatsPush(stats=stats, stage_latency=[("tts", 0.2)]))
    assert figures.stats() == stats
    assert figures.drain_stage_latencies() == [("asr", 0.1), ("tts", 0.2)]
    assert figures.drain_stage_latencies() == []
    assert figures.drain_stage_steps() == [("llm", 2)]
    assert figures.drain_stage_waits() == figures.drain_stage_decodes() == []
