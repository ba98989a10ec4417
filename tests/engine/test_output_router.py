"""OutputRouter (engine/orchestration/output_router.py): stale-fence output is dropped and
counted, a final done is not, events without a fence and raw outputs pass as they are."""

from __future__ import annotations

from duplex_contract.fence import Fence
from duplex_contract.session_events import ResponseDone, SessionLifecycle, TextDelta
from engine.messages import EngineOutput, SessionOutput
from engine.orchestration.counters import Counters
from engine.orchestration.output_router import OutputRouter

OLD, NEW = Fence("sess_a", 0, 1, 1), Fence("sess_a", 1, 1, 1)


def _router() -> tuple[OutputRouter, list[EngineOutput], Counters]:
    put: list[EngineOutput] = []
    counters = Counters()
    return OutputRouter(put.append, lambda fence: fence == NEW, counters), put, counters


def test_current_output_is_routed_to_its_session() -> None:
    router, put, counters = _router()
    router.emit("sess_a", TextDelta(fence=NEW, text="hi"))
    assert put == [SessionOutput(session_id="sess_a", event=TextDelta(fence=NEW, text="hi"))]
    assert counters.stale_dropped == 0


def test_stale_output_is_dropped_and_counted() -> None:
    router, put, counters = _router()
    router.emit("sess_a", TextDelta(fence=OLD, text="late"))
    router.emit("sess_a", ResponseDone(fence=OLD, status="completed"))
    assert put == [] and counters.stale_dropped == 2


def test_a_final_done_of_a_stale_fence_is_routed() -> None:
    router, put, counters = _router()
    done = ResponseDone(fence=OLD, status="cancelled", reason="barge_in")
    router.emit("sess_a", done, final=True)
    assert put == [SessionOutput(session_id="sess_a", event=done)]
    assert counters.stale_dropped == 0


def test_events_without_a_fence_and_raw_outputs_pass() -> None:
    router, put, _ = _router()
    expired = SessionLifecycle(session_id="sess_a", state="expired", reason="idle")
    router.emit("sess_a", expired)
    raw = SessionOutput(session_id="sess_b", event=TextDelta(fence=OLD, text="x"))
    router.put(raw)  # put as it is: no fence check
    assert put == [SessionOutput(session_id="sess_a", event=expired), raw]


def test_outputs_of_one_loop_iteration_are_put_once_in_order() -> None:
    """OutputBatch: one put per loop iteration (a list when there are several, the output
    itself when one), in order; flush puts what is pending at once (before a control result
    goes on the other queue) and then the scheduled flush finds nothing."""
    import asyncio

    from engine.orchestration.output_router import OutputBatch

    def out(text: str) -> SessionOutput:
        return SessionOutput(session_id="sess_a", event=TextDelta(fence=NEW, text=text))

    async def main() -> list[object]:
        puts: list[object] = []
        batch = OutputBatch(puts.append)
        batch(out("a"))
        batch(out("b"))
        assert puts == []  # the iteration goes on
        await asyncio.sleep(0)
        batch(out("c"))
        await asyncio.sleep(0)
        batch(out("d"))
        batch.flush()
        assert puts[-1] == out("d")
        await asyncio.sleep(0)
        batch.flush()  # nothing pending: nothing put
        return puts

    assert asyncio.run(main()) == [[out("a"), out("b")], out("c"), out("d")]
