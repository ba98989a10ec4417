"""OpenTelemetry traces (``server.otel``, docs/protocol.md §13): a real server
(configs/test.yaml) exports to an in-process OTLP/HTTP receiver that decodes the real
protobuf; real WebSocket clients talk to it.

One trace per session: a ``session`` root, a ``turn`` per response with the timeline's
spans under it, the engine's per-stage-request spans under the turn, a barge-in as an
event; off (no endpoint) or sampled out, nothing reaches the receiver.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from duplex_contract.errors import ConfigError
from duplex_server.config import load_app_config
from tests.server.harness import (
    REALTIME_TTS,
    Client,
    running_server,
    send_audio,
    silence,
    text_item,
    tone,
    write_config,
)
from tests.server.otlp_receiver import OtlpReceiver, ReceivedSpan

TIMELINE = {"vad.commit", "asr", "llm.first_token", "tts.first_audio", "audio.first_sent"}
SLACK_NS = 2_000_000  # clocks are converted monotonic -> wall per span: allow 2 ms


def otel(url: str, **kw: Any) -> dict[str, Any]:
    return {"otel": {"endpoint": url, "export_delay_ms": 50, "service_name": "dx-test", **kw}}


def children(spans: list[ReceivedSpan], parent: ReceivedSpan) -> list[ReceivedSpan]:
    return [s for s in spans if s.parent_id == parent.span_id]


def one_trace(spans: list[ReceivedSpan], sid: str) -> tuple[ReceivedSpan, list[ReceivedSpan]]:
    """The session span of ``sid`` and every span of its trace."""
    roots = [s for s in spans if s.name == "session" and s.attrs.get("duplex.session_id") == sid]
    assert len(roots) == 1, [s.attrs for s in spans if s.name == "session"]
    root = roots[0]
    assert root.parent_id == "" and root.resource["service.name"] == "dx-test"
    trace = [s for s in spans if s.trace_id == root.trace_id]
    # nothing of another session in this trace
    assert {s.attrs["duplex.session_id"] for s in trace if "duplex.session_id" in s.attrs} == {sid}
    return root, trace


def check_within(child: ReceivedSpan, parent: ReceivedSpan) -> None:
    assert parent.start_ns - SLACK_NS <= child.start_ns <= child.end_ns, child
    assert child.end_ns <= parent.end_ns + SLACK_NS, (child, parent)


async def speak(c: Client, pcm: bytes, chunk_ms: int = 40) -> None:
    """24 kHz PCM16 in real time, as a microphone sends it (the trace dates a turn from
    the speech's start on the input clock)."""
    step = 24 * chunk_ms * 2
    for i in range(0, len(pcm), step):
        await send_audio(c, pcm[i : i + step], chunk_ms=chunk_ms)
        await asyncio.sleep(chunk_ms / 1000)


async def voice_session(addr: str) -> str:
    """A spoken turn, answered in real time, interrupted by speech that becomes the next
    turn, answered to the end."""
    async with Client.connect(addr) as c:
        created = await c.until("session.created")
        await speak(c, tone(600) + silence(800))
        first = await c.until("response.output_audio.delta", within=10)
        await speak(c, tone(500))  # the user talks over the answer
        done = await c.until("response.done")
        assert done["response"]["status"] == "cancelled"
        assert done["response"]["id"] == first["response_id"]
        await speak(c, silence(800))
        while (done := await c.until("response.done", within=20))["response"]["status"] != (
            "completed"
        ):
            pass
        await c.send({"type": "session.close"})
        await c.until("session.closed")
        sid: str = created["session"]["id"]
        return sid


async def text_session(addr: str) -> str:
    async with Client.connect(addr) as c:
        created = await c.until("session.created")
        await c.send({"type": "session.update", "session": {"output_modalities": ["text"]}})
        await c.send(text_item("hello"))
        await c.send({"type": "response.create"})
        done = await c.until("response.done", within=10)
        assert done["response"]["status"] == "completed"
        await c.send({"type": "session.close"})
        await c.until("session.closed")
        sid: str = created["session"]["id"]
        return sid


def test_one_trace_per_session_with_turns_timeline_engine_spans_and_a_barge_in(
    tmp_path: Path,
) -> None:
    with OtlpReceiver.running() as rx:
        path = write_config(tmp_path, engine=REALTIME_TTS, server=otel(rx.url))

        async def both(addr: str) -> tuple[str, str]:
            return await asyncio.gather(voice_session(addr), text_session(addr))

        with running_server(path) as addr:
            voice, text = asyncio.run(both(addr))
        # the server has stopped: its tracer provider flushed every span
        spans = list(rx.spans)

    # -- the spoken session: a cancelled turn (barge-in), then an answered one
    root, trace = one_trace(spans, voice)
    assert "barge_in" in root.events
    assert root.attrs["duplex.close_reason"] == "client"
    turns = sorted((s for s in trace if s.name == "turn"), key=lambda s: s.start_ns)
    assert all(t.parent_id == root.span_id for t in turns)
    cancelled = [t for t in turns if t.attrs["duplex.cancelled"]]
    answered = [t for t in turns if t.attrs["duplex.status"] == "completed"]
    assert cancelled and answered, [t.attrs for t in turns]
    cut = cancelled[0]
    assert cut.attrs["duplex.reason"] == "turn_detected" and "barge_in" in cut.events
    assert not cut.error
    last = answered[-1]
    assert last.attrs["duplex.route"] == "voice"
    assert last.attrs["duplex.response_id"].startswith("resp_")
    # the answered turn began with the speech that interrupted the first answer
    assert cut.start_ns < last.start_ns < cut.end_ns
    for turn in (cut, last):
        check_within(turn, root)
    # the timeline under the answered turn, inside it and in the timeline's order
    timeline = {s.name: s for s in children(trace, last) if s.name in TIMELINE}
    assert set(timeline) == TIMELINE, sorted(timeline)
    for span in timeline.values():
        check_within(span, last)
    assert timeline["vad.commit"].end_ns <= timeline["asr"].start_ns + SLACK_NS
    assert timeline["llm.first_token"].end_ns == timeline["tts.first_audio"].start_ns
    assert timeline["tts.first_audio"].start_ns >= timeline["asr"].end_ns - SLACK_NS
    assert timeline["audio.first_sent"].start_ns >= timeline["asr"].end_ns - SLACK_NS
    # the engine's stage requests are children of the turn they served, the ones started
    # at a pause in the speech (a transcript guessed and answered ahead of the commit) too
    engine = [s for s in trace if s.name.startswith("engine.")]
    for turn in (cut, last):
        under = {s.name for s in children(engine, turn)}
        assert {"engine.asr", "engine.llm", "engine.tts"} <= under, under
    assert {s.parent_id for s in engine} <= {t.span_id for t in turns}
    for span in engine:
        assert span.attrs["duplex.stage"] == span.name.removeprefix("engine.")
        assert span.attrs["duplex.replica"] == 0
        assert span.attrs["duplex.session_id"] == voice
        assert span.attrs["duplex.priority"] in {"realtime", "draft", "speculative"}
        if span.attrs["duplex.priority"] == "draft":  # below real-time: a draft's own requests
            assert "/draft" in span.attrs["duplex.request_id"], span.attrs
        assert "first_output" in span.events and not span.error
    assert not any(s.attrs["duplex.cancelled"] for s in children(engine, last))
    # the interrupted answer's speech was stopped in the engine
    assert any(s.attrs["duplex.cancelled"] for s in children(engine, cut))

    # -- the text session: its own trace, a text turn without speech
    root_t, trace_t = one_trace(spans, text)
    assert root_t.trace_id != root.trace_id
    (turn,) = [s for s in trace_t if s.name == "turn"]
    assert turn.attrs["duplex.route"] == "text" and turn.attrs["duplex.status"] == "completed"
    names = {s.name for s in children(trace_t, turn)}
    assert "llm.first_token" in names and "engine.llm" in names
    assert "vad.commit" not in names and "tts.first_audio" not in names


def _quiet_turns(addr: str) -> None:
    asyncio.run(text_session(addr))


def test_tracing_off_builds_no_exporter_and_sends_nothing(tmp_path: Path) -> None:
    with OtlpReceiver.running() as rx:
        path = write_config(tmp_path)  # no server.otel
        apps: list[Any] = []
        with running_server(path, apps=apps) as addr:
            _quiet_turns(addr)
            assert apps[0].state.tracing is None
            hub = apps[0].state.hub
            assert hub.sessions.tracing is None
        assert rx.requests == 0 and rx.spans == []


def test_a_session_sampled_out_sends_nothing(tmp_path: Path) -> None:
    with OtlpReceiver.running() as rx:
        path = write_config(tmp_path, server=otel(rx.url, sample_ratio=0.0))
        apps: list[Any] = []
        with running_server(path, apps=apps) as addr:
            _quiet_turns(addr)
            assert apps[0].state.tracing is not None  # on, but this session is not sampled
        assert rx.spans == []


@pytest.mark.parametrize(
    ("otel_config", "field"),
    [
        ({"endpoint": "http://127.0.0.1:4318/v1/traces", "sample_ratio": 2}, "sample_ratio"),
        ({"endpoint": "collector:4318"}, "endpoint"),
        ({"endpoint": "http://127.0.0.1:4318/v1/traces", "export_delay_ms": 0}, "export_delay"),
        ({"endpoint": "http://127.0.0.1:4318/v1/traces", "max_queue": 0}, "max_queue"),
    ],
)
def test_a_bad_otel_config_fails_start_up_naming_the_field(
    tmp_path: Path, otel_config: dict[str, Any], field: str
) -> None:
    path = write_config(tmp_path, server={"otel": otel_config})
    with pytest.raises(ConfigError, match=rf"server\.otel\.{field}"):
        load_app_config(path)
