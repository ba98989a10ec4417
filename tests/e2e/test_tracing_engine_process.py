"""Traces across processes: a front end (`duplex-server serve --engine`) and the engine in
its own process (`duplex-server engine`), both with ``server.otel`` pointing at one
in-process OTLP/HTTP receiver (the real protobuf decoded). The engine's per-stage-request
spans join the front end's trace, under the turn they served, through the ``traceparent``
carried on the engine socket."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.e2e.test_engine_process import topology
from tests.server.harness import REALTIME_TTS, Client, silence, text_item, tone, write_config
from tests.server.otlp_receiver import OtlpReceiver
from tests.server.test_tracing import children, one_trace, otel, speak

#: the LLM on the batching runtime (its spans carry a batch size), speech in real time
ENGINE = {
    "stages": {
        **REALTIME_TTS["stages"],
        "llm": {"backend": "test-batch", "options": {"step_s": 0.002}},
    }
}


async def session(addr: str) -> str:
    """A spoken answer cancelled mid-speech, then a spoken turn answered to the end."""
    async with Client.connect(addr) as c:
        created = await c.until("session.created")
        await c.send(text_item("talk to me"))
        await c.send({"type": "response.create"})
        await c.until("response.output_audio.delta", within=10)
        await c.send({"type": "response.cancel"})
        done = await c.until("response.done")
        assert done["response"]["status"] == "cancelled"
        await speak(c, tone(600) + silence(800))
        done = await c.until("response.done", within=20)
        assert done["response"]["status"] == "completed"
        await c.send({"type": "session.close"})
        await c.until("session.closed")
        sid: str = created["session"]["id"]
        return sid


def test_engine_process_spans_join_the_front_ends_trace(tmp_path: Path) -> None:
    with OtlpReceiver.running() as rx:
        config = write_config(tmp_path, engine=ENGINE, server=otel(rx.url))
        with topology(config, fronts=1) as (_engine, front):
            sid = asyncio.run(session(front[0][1]))
        # both processes stopped (SIGTERM): each flushed its spans on the way out
        spans = list(rx.spans)

    root, trace = one_trace(spans, sid)
    assert root.resource["duplex.process"] == "server"
    turns = sorted((s for s in trace if s.name == "turn"), key=lambda s: s.start_ns)
    assert [t.attrs["duplex.status"] for t in turns] == ["cancelled", "completed"]
    engine = [s for s in trace if s.resource.get("duplex.process") == "engine"]
    assert engine, "no engine-process span joined the session's trace"
    assert {s.name for s in engine} == {"engine.asr", "engine.llm", "engine.tts"}
    assert root.resource["service.instance.id"] != engine[0].resource["service.instance.id"]
    # every engine span hangs under one of the front end's turns
    assert {s.parent_id for s in engine} <= {t.span_id for t in turns}
    cancelled, answered = turns
    assert any(s.attrs["duplex.cancelled"] for s in children(engine, cancelled))
    under = {s.name for s in children(engine, answered)}
    assert under == {"engine.asr", "engine.llm", "engine.tts"}, under
    for span in engine:
        assert span.attrs["duplex.replica"] == 0 and span.attrs["duplex.session_id"] == sid
    llm = [s for s in engine if s.name == "engine.llm"]
    assert all(s.attrs["duplex.batch_size"] >= 1 for s in llm), [s.attrs for s in llm]
    # no engine span outside a session's trace (nothing without a caller's context)
    assert {s.trace_id for s in spans if s.resource.get("duplex.process") == "engine"} == {
        root.trace_id
    }
