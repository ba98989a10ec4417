"""GPT-Live (``/v1/live/sessions``) end to end with OpenAI's own SDK client, unmodified, on
the deterministic test stages: a spoken turn with transcripts and paced audio, talking
over an answer (no client event) and the history cut to what was sent, delegation in
client and responses mode (function calls made by the test stage's scripted LLM), usage
and close, the documented errors, a reconnect through ``on_reconnecting``, WebRTC offer /
answer, ``max_sessions`` shared with /v1/realtime and /metrics by protocol
(docs/protocol.md, "GPT-Live")."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import websockets

from tests.e2e.live_sdk import CutProxy, LiveCall, live_call, sdk
from tests.server.harness import (
    UNIT,
    Client,
    http_text,
    running_server,
    silence,
    tone,
    write_config,
)

#: what the test ASR hears in every turn; the LLM echoes its prompt, so the first answer
#: is these words
HEARD = "please tell me a long story about the sea and the ships that sail on it every day"
TASK = '{"task": "book a table for two at eight"}'
ORDER = {"type": "object", "properties": {"order": {"type": "string"}}, "required": ["order"]}
BACKEND = {
    "model": "backend-1",
    "instructions": "You look up orders.",
    "tools": [{"type": "function", "name": "lookup_order", "parameters": ORDER}],
}


def _config(
    tmp: Path,
    *,
    realtime_tts: bool = False,
    ms_per_word: float = 200,
    short_prompt: bool = False,
    interruption: str | None = None,
    short_asr: str | None = None,
    **server: Any,
) -> Path:
    llm = {
        "backend": "test",
        "options": {
            "token_interval_s": 0.002,
            "echo_prompt": True,
            "tool_calls": ["delegate"],
            "tool_arguments": {"delegate": TASK},
        },
    }
    backend = {
        "backend": "test",
        "options": {
            "role": "llm",
            "echo_prompt": True,
            "tool_calls": ["lookup_order"],
            "tool_arguments": {"lookup_order": '{"order": "A17"}'},
        },
    }
    tts = {"backend": "test", "options": {"realtime": realtime_tts, "ms_per_word": ms_per_word}}
    asr: dict[str, Any] = {"transcript": HEARD}
    if short_asr is not None:  # a short speech (under 1 s of audio) is heard as this
        asr["short_transcript"] = short_asr
        asr["short_below_ms"] = 1000
    engine = {
        "stages": {"asr": {"backend": "test", "options": asr}, "llm": llm},
        "routes": {
            "voice": ["asr", "llm", "tts"],
            "text": ["asr", "llm"],
            "speech": ["tts"],
            "transcribe": ["asr"],
            "delegate": ["backend"],
        },
    }
    if short_prompt:  # the echoing LLM says the newest turn and what follows it, whole
        engine["duplex"] = {"max_sessions": 1000, "history_budget_chars": 2000}
        engine["max_output_tokens"] = 600
    engine["stages"]["tts"] = tts  # type: ignore[index]
    engine["stages"]["backend"] = backend  # type: ignore[index]
    live: dict[str, Any] = {"backend_route": "delegate", "usage_interval_s": 1.0}
    if interruption is not None:
        live["interruption"] = interruption
    return write_config(tmp, engine=engine, server={"live": live, **server})


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with running_server(_config(Path(tmp_path_factory.mktemp("live")))) as addr:
        yield addr


@pytest.fixture(scope="module")
def quick_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Short words: the echoing LLM's long answers are said in a few seconds."""
    path = _config(Path(tmp_path_factory.mktemp("live_quick")), ms_per_word=20, short_prompt=True)
    with running_server(path) as addr:
        yield addr


@pytest.fixture(scope="module")
def confirm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``interruption: confirm``; a short speech is heard as "mm-hm" (a backchannel)."""
    path = _config(
        Path(tmp_path_factory.mktemp("live_confirm")), interruption="confirm", short_asr="mm-hm"
    )
    with running_server(path) as addr:
        yield addr


@pytest.fixture(scope="module")
def rt_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The TTS speaks at real time: an answer is still being made when it is talked over."""
    path = _config(Path(tmp_path_factory.mktemp("live_rt")), realtime_tts=True)
    with running_server(path) as addr:
        yield addr


async def _events_until_closed(conn: Any) -> list[Any]:
    """Every event until the server closes (a close after an error is not a 1000)."""
    events: list[Any] = []
    with contextlib.suppress(websockets.ConnectionClosed):
        async with asyncio.timeout(10 * UNIT):
            async for event in conn:
                events.append(event)
    return events


async def _speak(call: LiveCall, ms: float = 800) -> None:
    """A user turn: speech, then the silence that ends it."""
    await call.stream(silence(200) + tone(ms) + silence(700))


async def _keep_streaming(call: LiveCall, stop: asyncio.Event) -> None:
    """A microphone that goes on sending silence."""
    while not stop.is_set() and not call.closed.is_set():
        await call.stream(silence(100))


# ---------------------------------------------------------------------------- a spoken turn
def test_spoken_turn_transcripts_paced_audio_usage_and_close(server: str) -> None:
    async def run() -> None:
        session = {"model": "gpt-live-1", "audio": {"format": {"type": "audio/pcm", "rate": 24000}}}
        async with live_call(server, session) as call:
            started = call.of("session.started")[0]
            res = started.session
            assert (
                res.id.startswith("sess_") and res.status == "active" and res.model == "gpt-live-1"
            )
            assert res.audio.format.type == "audio/pcm" and res.audio.format.rate == 24000
            assert res.audio.output.voice == "marin" and res.expires_at > time.time() + 3600
            assert started.resume_token.startswith(res.id + ".")
            assert getattr(started, "server_event_seq", None) is None  # Live has no seq
            await _speak(call)
            heard = await call.until("session.input_transcript.delta")
            assert heard.delta == HEARD and 0 <= heard.start_ms < heard.end_ms
            stop = asyncio.Event()
            mic = asyncio.create_task(_keep_streaming(call, stop))
            await call.until(
                "session.output_transcript.delta", within=20, pred=lambda e: e.delta.endswith("day")
            )
            stop.set()
            await mic
            said = call.of("session.output_transcript.delta")
            assert "".join(e.delta for e in said) == HEARD  # the echo of the user's turn
            assert said[0].start_ms >= heard.end_ms
            for a, b in itertools.pairwise(said):
                assert a.start_ms <= a.end_ms <= b.start_ms + 1
            # paced: each delta arrives no more than ~200 ms ahead of real time
            audio = [(t, e) for t, e in call.events if e.type == "session.output_audio.delta"]
            t0, sent_ms = audio[0][0], 0.0
            worst = 0.0
            for t, e in audio:
                sent_ms += len(e.delta) * 3 / 4 / 2 / 24  # base64 -> bytes -> samples -> ms
                worst = max(worst, sent_ms - (t - t0) * 1000)
            assert worst <= 200 + 60 + 40, worst  # lead + one slice, with scheduling slack
            total_ms = call.audio_bytes / 48
            assert (audio[-1][0] - t0) * 1000 >= total_ms - 260, "audio came faster than real time"
            assert said[-1].end_ms - said[0].start_ms == pytest.approx(total_ms, abs=250)
            await call.until("session.usage.updated")
            n = len(call.events)
            await call.conn.session.close()
            closed = await call.until("session.closed", after=n)
            assert closed.reason == "close_requested" and closed.session.id == res.id
            last_usage = call.of("session.usage.updated")[-1]
            assert last_usage.usage.seconds == closed.usage.seconds > 1.0
            assert 0 < last_usage.context_window.usage_ratio < 1
            await asyncio.wait_for(call.closed.wait(), 5 * UNIT)  # the server closed (1000)

    asyncio.run(run())


# ---------------------------------------------------------------------------- talking over
@pytest.mark.parametrize("fixture", ["server", "rt_server"])
def test_talking_over_an_answer_stops_it_and_the_history_keeps_what_was_sent(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    """No client event: the user speaks over the answer and its audio stops; the output
    transcript holds only words whose audio was sent, and the next prompt holds the same
    cut of the answer (the LLM echoes its prompt: user | assistant | user)."""
    addr = request.getfixturevalue(fixture)

    async def run() -> None:
        async with live_call(addr, {"model": "gpt-live-1"}) as call:
            await _speak(call)
            stop = asyncio.Event()
            mic = asyncio.create_task(_keep_streaming(call, stop))
            await call.until("session.output_transcript.delta", within=20)
            await asyncio.sleep(1.2)  # a few words in
            stop.set()
            await mic
            first_words = len(call.of("session.output_transcript.delta"))
            onset = time.monotonic()
            n = len(call.events)
            await call.stream(tone(700) + silence(900))
            # the old answer's audio: what arrived from the onset until the pause before the
            # next answer (that one starts after the turn's silence)
            old = [t for t, e in call.events[n:] if e.type == "session.output_audio.delta"]
            old = [t for t in old if t < onset + 0.9]
            heard_stop = call.played_out(max(old)) if old else onset
            assert heard_stop - onset < 0.8 * UNIT, heard_stop - onset
            await call.until("session.input_transcript.delta", after=n)  # the new turn
            turn2 = next(
                i
                for i, (_, e) in enumerate(call.events)
                if i >= n and e.type == "session.input_transcript.delta"
            )
            spoken = "".join(
                e.delta
                for _, e in call.events[:turn2]
                if e.type == "session.output_transcript.delta"
            )
            assert HEARD.startswith(spoken) and len(spoken) < len(HEARD) - 10, spoken
            assert len(call.of("session.output_transcript.delta")) >= first_words
            stop = asyncio.Event()
            mic = asyncio.create_task(_keep_streaming(call, stop))
            await call.until(
                "session.output_transcript.delta",
                within=20,
                after=turn2,
                pred=lambda e: call.transcript(after=turn2).count(" | ") >= 2,
            )
            stop.set()
            await mic
            parts = call.transcript(after=turn2).split(" | ")
            assert parts[0] == HEARD and len(parts) >= 2
            # the history's cut answer ends with the engine's cut mark (history.py)
            assert parts[1].endswith("... (interrupted)"), parts[1]
            kept = parts[1].removesuffix("... (interrupted)")
            assert HEARD.startswith(kept) and len(kept) < len(HEARD)
            if fixture == "server":
                # the clause was made whole before it was cut: the history's cut and the
                # transcript's are one rule (to a word)
                assert abs(len(kept.split()) - len(spoken.split())) <= 1, (kept, spoken)
            else:
                # the answer was cancelled while its clause was still being made: the
                # engine's history cuts the clause in proportion to the audio it made, not
                # the clause's whole length (docs/protocol.md, "GPT-Live"), so it may keep a
                # few words more than left; never fewer
                assert len(kept.split()) >= len(spoken.split()) - 1, (kept, spoken)

    asyncio.run(run())


def test_confirm_a_backchannel_pauses_the_answer_and_it_goes_on_whole(
    confirm_server: str,
) -> None:
    """``interruption: confirm``: an "mm-hm" over the answer pauses it at once (the pacer
    stops sending), its words take the pause back, and the answer goes on from the last
    audio sent: the client gets the same audio, byte for byte, and the same transcript as
    a listener who said nothing; the "mm-hm" is no turn (docs/protocol.md, "GPT-Live")."""

    async def answer(backchannel: bool) -> tuple[int, str, list[float], float, int]:
        async with live_call(confirm_server, {"model": "gpt-live-1"}) as call:
            await _speak(call)
            stop = asyncio.Event()
            mic = asyncio.create_task(_keep_streaming(call, stop))
            await call.until("session.output_transcript.delta", within=20)
            onset = time.monotonic()
            n = len(call.events)
            if backchannel:
                await asyncio.sleep(1.2)  # a few words in
                stop.set()
                await mic
                onset = time.monotonic()
                n = len(call.events)
                await call.stream(tone(250) + silence(300))
                stop = asyncio.Event()
                mic = asyncio.create_task(_keep_streaming(call, stop))
            await call.until(
                "session.output_transcript.delta",
                within=30,
                pred=lambda e: call.transcript() == HEARD,
            )
            await asyncio.sleep(0.5)  # anything more (there must be nothing)
            stop.set()
            await mic
            times = [t for t, e in call.events if e.type == "session.output_audio.delta"]
            # the last audio before the onset, and all after (the pause can come before the
            # pacer's next slice: at the VAD's first window of voice)
            first = sum(1 for t, e in call.events[:n] if e.type == "session.output_audio.delta")
            times = times[max(0, first - 1) :]
            turns = len(call.of("session.input_transcript.delta"))
            return call.audio_bytes, call.transcript(), times, onset, turns

    async def run() -> None:
        whole, said, _, _, turns = await answer(backchannel=False)
        assert said == HEARD and turns == 1
        got, said, times, onset, turns = await answer(backchannel=True)
        assert said == HEARD  # every word once, in order
        assert turns == 1  # the "mm-hm" was no turn
        assert got == whole  # the same audio: nothing lost, nothing sent twice
        # the pause: the audio stopped soon after the onset and came back later
        gap, at = max((b - a, a) for a, b in itertools.pairwise(times))
        assert gap > 0.25, gap
        assert at - onset < 0.8 * UNIT, at - onset

    asyncio.run(run())


# ---------------------------------------------------------------------------- delegation
def test_client_delegation_commentary_thinking_and_errors(quick_server: str) -> None:
    async def run() -> None:
        session = {"model": "gpt-live-1", "delegation": {"type": "client"}}
        async with live_call(quick_server, session) as call:
            assert call.of("session.started")[0].session.delegation.type == "client"
            await _speak(call)
            created = await call.until("session.delegation.created", within=15)
            d = created.delegation
            assert d.type == "delegation" and d.target == "client" and d.id.startswith("deleg_")
            assert created.offset_ms > 0 and not getattr(d, "task", None)  # no task text
            conn = call.conn
            await conn.session.thinking.append(
                content="The guest is a regular.", delegation_id=d.id
            )
            await call.until("session.thinking.appended")
            n = len(call.events)
            await conn.session.commentary.append(
                content="Booked: a table for two at eight.", delegation_id=d.id, event_id="c1"
            )
            appended = await call.until("session.commentary.appended", after=n)
            assert appended.client_event_id == "c1" and appended.start_ms == appended.end_ms
            stop = asyncio.Event()
            mic = asyncio.create_task(_keep_streaming(call, stop))
            # said in the model's words: the echoing LLM's prompt shows the call and results
            await call.until(
                "session.output_transcript.delta",
                within=20,
                after=n,
                pred=lambda e: "Booked" in call.transcript(after=n) and "eight." in e.delta,
            )
            said = call.transcript(after=n)
            assert "You called delegate with" in said and "book a table for two" in said
            assert "it returned The guest is a regular." in said
            await conn.session.instructions.append(content="Be brief.", delegation_id=None)
            await call.until("session.instructions.appended")
            n = len(call.events)
            await conn.session.commentary.append(content="x", delegation_id="deleg_nope")
            err = await call.until("error", after=n)
            assert err.error.code == "invalid_value" and err.error.param == "delegation_id"
            await conn.response.create(event_id="r1")
            err = await call.until("error", after=n, pred=lambda e: e.error.client_event_id == "r1")
            assert err.error.code == "invalid_state"
            stop.set()
            await mic

    asyncio.run(run())


def test_responses_delegation_function_call_round_trip(quick_server: str) -> None:
    """The backend (a route of its own) calls the app's function; its output goes back
    with response.item.create + response.create; the answer is said; events stream as
    response.event in Responses' order; a barge-in meanwhile does not stop it."""

    async def run() -> None:
        session = {
            "model": "gpt-live-1",
            "delegation": {"type": "responses", "responses": BACKEND},
        }
        async with live_call(quick_server, session) as call:
            conn = call.conn
            await _speak(call)
            created = await call.until("session.delegation.created", within=15)
            d = created.delegation
            assert d.target == "responses" and d.response_id
            await _speak(call, 500)  # the user talks meanwhile: the delegation goes on
            done = await call.until(
                "response.event",
                within=20,
                pred=lambda e: e.event["type"] == "response.output_item.done",
            )
            item = done.event["item"]
            assert item["type"] == "function_call" and item["name"] == "lookup_order"
            assert json.loads(item["arguments"]) == {"order": "A17"}
            n = len(call.events)
            await conn.response.create(event_id="early")
            err = await call.until("error", after=n)
            assert err.error.code == "function_call_outputs_required"
            await conn.response.item.create(
                item={
                    "type": "function_call_output",
                    "call_id": item["call_id"],
                    "output": '{"status": "shipped"}',
                }
            )
            await conn.response.create()
            completed = await call.until(
                "response.event",
                within=20,
                after=n,
                pred=lambda e: (
                    e.event["type"] == "response.completed"
                    and e.event["response"]["id"] != d.response_id
                    and e.delegation_id == d.id
                ),
            )
            usage = completed.event["response"]["usage"]
            assert usage["input_tokens"] > 0 and usage["output_tokens"] > 0
            kinds = [e.event["type"] for e in call.of("response.event") if e.delegation_id == d.id]
            first = kinds[: kinds.index("response.completed") + 1]
            assert first == [
                "response.created",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.completed",
            ]
            rest = kinds[len(first) :]
            assert rest[:3] == [
                "response.created",
                "response.output_item.added",
                "response.content_part.added",
            ]
            assert rest[-4:] == [
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.completed",
            ]
            seqs = [
                e.event["sequence_number"]
                for e in call.of("response.event")
                if e.delegation_id == d.id
            ]
            assert seqs == list(range(1, len(seqs) + 1))
            # the backend's answer (its prompt echoed: the task and the function's result)
            # reaches the thinker as the delegation's result and is said
            stop = asyncio.Event()
            mic = asyncio.create_task(_keep_streaming(call, stop))
            await call.until(
                "session.output_transcript.delta",
                within=30,
                after=n,
                pred=lambda e: "shipped" in call.transcript(after=n),
            )
            stop.set()
            await mic
            n = len(call.events)
            await conn.session.commentary.append(content="x", delegation_id=d.id)
            err = await call.until("error", after=n)
            assert err.error.code == "invalid_value"  # ids are the backend's in this mode

    asyncio.run(run())


# ---------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("first", "code", "param"),
    [
        ({"type": "session.input_audio.append", "audio": ""}, "session_start_required", None),
        (
            {"type": "session.start", "session": {"model": "gpt-live-1", "voices": 1}},
            "unknown_parameter",
            "session.voices",
        ),
        (
            {
                "type": "session.start",
                "session": {
                    "model": "gpt-live-1",
                    "audio": {"format": {"type": "audio/pcm", "rate": 8000}},
                },
            },
            "invalid_value",
            "session.audio.format.rate",
        ),
        (
            {
                "type": "session.start",
                "session": {"model": "gpt-live-1", "audio": {"format": {"type": "audio/opus"}}},
            },
            "invalid_value",
            "session.audio.format.type",
        ),
        (
            {"type": "session.start", "session": {"model": "gpt-4o-realtime"}},
            "invalid_model",
            "session.model",
        ),
        (
            {
                "type": "session.start",
                "session": {"model": "gpt-live-1", "audio": {"output": {"voice": "fable"}}},
            },
            "forbidden",
            "session.audio.output.voice",
        ),
        (
            {
                "type": "session.start",
                "session": {
                    "model": "gpt-live-1",
                    "delegation": {"type": "decisions", "decisions": {}},
                },
            },
            "unsupported",
            "session.delegation.type",
        ),
    ],
)
def test_bad_start_gets_the_documented_error_and_a_close(
    server: str, first: dict[str, Any], code: str, param: str | None
) -> None:
    async def run() -> None:
        client = sdk(server)
        async with client.live.connect() as conn:
            await conn.send(first)  # type: ignore[arg-type]
            events = await _events_until_closed(conn)
            assert [e.type for e in events] == ["error"]
            err = events[0].error
            assert (err.type, err.code, err.param) == ("invalid_request_error", code, param)
            assert err.message
        await client.close()

    asyncio.run(run())


def test_unsupported_and_wrong_events_keep_the_session(server: str) -> None:
    async def run() -> None:
        async with live_call(server, {"model": "gpt-live-1"}) as call:
            conn = call.conn
            await conn.session.output_audio.fixture.play(audio="", event_id="f1")
            err = await call.until("error")
            assert (err.error.code, err.error.client_event_id) == ("unsupported", "f1")
            await conn.send({"type": "session.input_audio.append", "audio": "", "extra": 1})  # type: ignore[arg-type, typeddict-unknown-key]
            err = await call.until("error", pred=lambda e: e.error.code == "unknown_parameter")
            assert err.error.param == "extra"
            await conn.session.input_audio.mute(event_id="m")
            assert (await call.until("session.input_audio.muted")).client_event_id == "m"
            await conn.session.input_audio.unmute()
            await call.until("session.input_audio.unmuted")
            await _speak(call)  # the session goes on
            await call.until("session.input_transcript.delta")

    asyncio.run(run())


def test_muted_input_is_silence_to_the_model(server: str) -> None:
    async def run() -> None:
        async with live_call(server, {"model": "gpt-live-1"}) as call:
            await call.conn.session.input_audio.mute()
            await call.until("session.input_audio.muted")
            await _speak(call)
            await asyncio.sleep(1.0)
            assert not call.of("session.input_transcript.delta")  # nothing was heard

    asyncio.run(run())


# ---------------------------------------------------------------------------- reconnect
def test_reconnect_through_on_reconnecting_resumes_the_session(server: str) -> None:
    """A network drop mid-session: the SDK reconnects by itself through the app's
    ``on_reconnecting``, which hands it the resume token of ``session.started`` (and the
    last event id it got); the same session goes on, nothing is replayed twice."""

    async def run() -> None:
        proxy = CutProxy(server)
        await proxy.start()
        state: dict[str, str] = {}

        def on_reconnecting(event: Any) -> dict[str, Any]:
            headers = {"X-Resume-Token": state["token"]}
            if "last" in state:
                headers["X-Last-Event-Id"] = state["last"]
            return {"extra_headers": headers}

        try:
            async with live_call(
                proxy.addr,
                {"model": "gpt-live-1"},
                on_reconnecting=on_reconnecting,
                initial_delay=0.1,
            ) as call:
                started = call.of("session.started")[0]
                state["token"] = started.resume_token
                await _speak(call)
                await call.until("session.input_transcript.delta")
                ids = [e.event_id for _, e in call.events if getattr(e, "event_id", None)]
                state["last"] = ids[-1]
                n = len(call.events)
                proxy.cut()
                info = await call.until("info", within=15, after=n)
                assert info.code == "session.resumed" and info.resume_token != state["token"]
                assert info.resume_token.startswith(started.session.id + ".")
                await _speak(call)  # the conversation goes on, on the same session
                await call.until("session.input_transcript.delta", within=15, after=n)
                new_ids = [e.event_id for _, e in call.events[n:] if getattr(e, "event_id", None)]
                seen = set(ids)
                assert not seen & set(new_ids)  # no event was sent twice
                assert all(i.startswith(started.event_id[:-7]) for i in new_ids)
        finally:
            await proxy.close()

    asyncio.run(run())


# ---------------------------------------------------------------------------- WebRTC
def test_webrtc_offer_answer_and_events_on_the_data_channel(server: str) -> None:
    from tests.server.webrtc_client import RtcClient

    async def run() -> None:
        rtc = RtcClient()
        client = sdk(server)
        try:
            await rtc.pc.setLocalDescription(await rtc.pc.createOffer())
            created = await client.live.create(
                session={"model": "gpt-live-1", "audio": {"output": {"voice": "cedar"}}},
                transport={"type": "webrtc", "sdp": rtc.pc.localDescription.sdp},
            )
            assert created.session.id.startswith("sess_") and created.transport.type == "webrtc"
            from aiortc import RTCSessionDescription

            await rtc.pc.setRemoteDescription(
                RTCSessionDescription(sdp=created.transport.sdp, type="answer")
            )
            started = await rtc.until("session.started", within=15)  # no session.start sent
            assert started["session"]["id"] == created.session.id
            assert started["session"]["audio"].get("format") is None
            rtc.mic.say += bytes(silence(300, 48000) + tone(800, 48000) + silence(900, 48000))
            heard = await rtc.until("session.input_transcript.delta", within=15)
            assert heard["delta"] == HEARD
            said = await rtc.until("session.output_transcript.delta", within=15)
            assert HEARD.startswith(said["delta"])
            kinds = set(rtc.kinds())
            assert not {k for k in kinds if k.startswith(("response.", "input_audio_buffer."))}
            rtc.send({"type": "session.close"})
            closed = await rtc.until("session.closed", within=10)
            assert closed["reason"] == "close_requested"
            with pytest.raises(openai.BadRequestError, match=r"refer is not supported") as refused:
                await client.live.sessions.refer(created.session.id, target_uri="tel:+1")
            assert refused.value.code == "unsupported"
        finally:
            await rtc.close()
            await client.close()

    asyncio.run(run())


# ---------------------------------------------------------------------------- capacity, metrics
def test_max_sessions_is_shared_with_realtime_and_metrics_label_protocols(tmp_path: Path) -> None:
    path = _config(tmp_path, realtime_tts=False)
    text = path.read_text().replace("max_sessions: 1000", "max_sessions: 2")
    path.write_text(text)

    async def run(addr: str) -> None:
        async with Client.connect(addr) as rt:
            await rt.until("session.created")
            async with live_call(addr, {"model": "gpt-live-1.1"}):
                metrics = http_text(addr, "/metrics")
                assert 'duplex_sessions_by_protocol{protocol="live"} 1.0' in metrics
                assert 'duplex_sessions_by_protocol{protocol="realtime"} 1.0' in metrics
                client = sdk(addr)
                async with client.live.connect() as conn:  # a third session: refused
                    await conn.session.start(session={"model": "gpt-live-1"})
                    events = await _events_until_closed(conn)
                    assert [e.type for e in events] == ["error"]
                    assert events[0].error.code == "resource_exhausted"
                await client.close()

    with running_server(path) as addr:
        asyncio.run(run(addr))
