"""Realtime API completeness against the real server on the deterministic test stages:
function calls (scripted), item operations, out-of-band responses, transcription sessions,
the idle timeout and the errors of each (docs/protocol.md)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from openai import AsyncOpenAI

from tests.server.harness import (
    UNIT,
    Client,
    b64,
    running_server,
    send_audio,
    silence,
    text_item,
    tone,
    write_config,
)

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "name": "get_weather", "description": "weather", "parameters": WEATHER},
    {"type": "function", "name": "get_time", "parameters": {"type": "object"}},
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The test stages; the LLM echoes its prompt and makes two scripted calls."""
    llm = {
        "backend": "test",
        "options": {
            "echo_prompt": True,
            "tool_calls": ["get_weather", "get_time"],
            "tool_arguments": {"get_weather": '{"city": "Paris", "unit": "c"}'},
        },
    }
    tts = {"backend": "test", "options": {"ms_per_word": 100}}
    engine = {"stages": {"llm": llm, "tts": tts}, "max_output_tokens": 400}
    path = write_config(Path(tmp_path_factory.mktemp("rt")), engine=engine)
    with running_server(path) as addr:
        yield addr


def _sdk(addr: str) -> AsyncOpenAI:
    return AsyncOpenAI(
        api_key="unused", base_url=f"http://{addr}/v1", websocket_base_url=f"ws://{addr}/v1"
    )


TEXT_SESSION = {"output_modalities": ["text"], "audio": {"input": {"turn_detection": None}}}


async def _text_session(c: Client, **extra: Any) -> None:
    await c.until("session.created")
    await c.send({"type": "session.update", "session": {**TEXT_SESSION, **extra}})
    await c.until("session.updated")


async def _response(c: Client, response: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """response.create; every event up to its response.done."""
    start = len(c.events)
    await c.send({"type": "response.create", **({"response": response} if response else {})})
    await c.until("response.done", within=10)
    return c.events[start:]


def _kinds(events: list[dict[str, Any]]) -> list[str]:
    return [e["type"] for e in events]


# ---------------------------------------------------------------------------- function calls
def test_sdk_scripted_tool_calls_round_trip(server: str) -> None:
    """Two calls in a row (the script), each answered; then a text reply that sees both."""

    async def run() -> None:
        client = _sdk(server)
        async with client.realtime.connect(model="duplex") as conn:
            await conn.session.update(
                session={
                    "type": "realtime",
                    "output_modalities": ["text"],
                    "tools": TOOLS,  # type: ignore[typeddict-item]
                    "tool_choice": "auto",
                }
            )
            await conn.conversation.item.create(
                item={
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "weather and time?"}],
                }
            )
            outputs = {"get_weather": '{"temp": 21}', "get_time": "it is noon (not JSON)"}
            calls: list[tuple[str, str]] = []
            for _ in range(3):
                await conn.response.create()
                deltas: list[str] = []
                async with asyncio.timeout(10 * UNIT):
                    async for event in conn:
                        if event.type == "response.function_call_arguments.delta":
                            deltas.append(event.delta)
                        elif event.type == "response.function_call_arguments.done":
                            assert "".join(deltas) == event.arguments
                            calls.append((event.name, event.arguments))
                        elif event.type == "response.done":
                            response = event.response
                            break
                assert response.status == "completed"
                item = (response.output or [None])[0]
                if item is not None and item.type == "function_call":
                    assert item.call_id and item.name == calls[-1][0]
                    await conn.conversation.item.create(
                        item={
                            "type": "function_call_output",
                            "call_id": item.call_id,
                            "output": outputs[item.name],
                        }
                    )
                else:
                    assert item is not None and item.type == "message"
                    text = item.content[0].text or ""  # type: ignore[union-attr]
            assert [name for name, _ in calls] == ["get_weather", "get_time"]
            weather_args = json.loads(calls[0][1])
            jsonschema.validate(weather_args, WEATHER)
            assert weather_args == {"city": "Paris", "unit": "c"}
            # the echoed prompt holds both calls and both results
            assert "You called get_weather" in text and "it returned temp 21." in text
            assert "it is noon (not JSON)" in text
        await client.close()

    asyncio.run(run())


def test_forced_and_none_tool_choice_per_response(server: str) -> None:
    async def run() -> None:
        async with Client.connect(server) as c:
            await _text_session(c, tools=TOOLS, tool_choice="none")
            await c.send(text_item("hi"))
            events = await _response(c)  # tool_choice none: a text reply
            assert "response.function_call_arguments.done" not in _kinds(events)
            forced = {"tool_choice": {"type": "function", "name": "get_time"}}
            events = await _response(c, forced)  # the override forces get_time
            done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
            assert done["name"] == "get_time" and json.loads(done["arguments"]) == {}
            kinds = _kinds(events)
            assert kinds.index("response.output_item.added") < kinds.index(
                "response.function_call_arguments.delta"
            )
            assert "response.content_part.added" not in kinds  # a call has no content part
            item = events[-1]["response"]["output"][0]
            assert item["type"] == "function_call" and item["call_id"] == done["call_id"]
            await c.send({"type": "conversation.item.retrieve", "item_id": item["id"]})
            got = await c.until("conversation.item.retrieved")
            assert got["item"]["arguments"] == done["arguments"]

    asyncio.run(run())


def test_pending_call_output_late_and_huge(server: str) -> None:
    """A call nobody answers does not block the next turn; a late, huge output is cut in
    the prompt but kept whole in the item."""

    async def run() -> None:
        async with Client.connect(server) as c:
            await _text_session(c, tools=TOOLS, tool_choice="required")
            await c.send(text_item("first"))
            events = await _response(c)
            call = events[-1]["response"]["output"][0]
            # no output comes: the next turn goes on (its prompt shows the call unanswered)
            await c.send(text_item("second"))
            events = await _response(c, {"tool_choice": "none"})
            text = events[-1]["response"]["output"][0]["content"][0]["text"]
            assert "get_weather" in text and "second" in text
            huge = "x" * 50_000
            out = {"type": "function_call_output", "call_id": call["call_id"], "output": huge}
            await c.send({"type": "conversation.item.create", "item": out})
            added = await c.until("conversation.item.done")
            await c.send({"type": "conversation.item.retrieve", "item_id": added["item"]["id"]})
            got = await c.until("conversation.item.retrieved")
            assert len(got["item"]["output"]) == 50_000
            events = await _response(c, {"tool_choice": "none"})
            text = events[-1]["response"]["output"][0]["content"][0]["text"]
            assert "characters cut]" in text and len(text) < 10_000

    asyncio.run(run())


def test_call_that_breaks_the_schema_fails_the_response(server: str) -> None:
    """The scripted get_time call has no arguments; a schema that requires one makes it
    invalid: the response fails with invalid_tool_call and the call cannot be answered."""
    strict = {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}
    tools = [{"type": "function", "name": "get_time", "parameters": strict}]

    async def run() -> None:
        async with Client.connect(server) as c:
            await _text_session(c, tools=tools, tool_choice="required")
            await c.send(text_item("time?"))
            done = (await _response(c))[-1]["response"]
            assert done["status"] == "failed"
            assert done["status_details"]["error"]["code"] == "invalid_tool_call"
            # the session goes on
            events = await _response(c, {"tool_choice": "none"})
            assert events[-1]["response"]["status"] == "completed"

    asyncio.run(run())


def test_tool_errors_name_the_field(server: str) -> None:
    async def run() -> None:
        async with Client.connect(server) as c:
            await c.until("session.created")

            async def error_of(event: dict[str, Any]) -> dict[str, Any]:
                await c.send(event)
                err: dict[str, Any] = (await c.until("error"))["error"]
                return err

            bad_schema = [{"type": "function", "name": "f", "parameters": {"type": 5}}]
            err = await error_of({"type": "session.update", "session": {"tools": bad_schema}})
            assert (err["code"], err["param"]) == ("invalid_value", "tools.0.parameters")
            err = await error_of(
                {"type": "session.update", "session": {"tools": [TOOLS[0], TOOLS[0]]}}
            )
            assert err["param"] == "tools.1.name"
            choice = {"type": "function", "name": "nope"}
            err = await error_of(
                {"type": "session.update", "session": {"tools": TOOLS, "tool_choice": choice}}
            )
            assert (err["code"], err["param"]) == ("invalid_value", "tool_choice.name")
            err = await error_of({"type": "response.create", "response": {"tool_choice": choice}})
            assert err["param"] == "response.tool_choice.name"
            out = {"type": "function_call_output", "call_id": "call_missing", "output": "{}"}
            err = await error_of({"type": "conversation.item.create", "item": out})
            assert (err["code"], err["param"]) == ("invalid_value", "item.call_id")
            nr = {"audio": {"input": {"noise_reduction": {"type": "loud"}}}}
            err = await error_of({"type": "session.update", "session": nr})
            assert err["code"] == "invalid_event"
            assert err["param"] == "session.audio.input.noise_reduction.type"
            err = await error_of({"type": "conversation.item.delete", "item_id": "nope"})
            assert (err["code"], err["param"]) == ("item_not_found", "item_id")
            # the session is unharmed
            await c.send({"type": "session.update", "session": TEXT_SESSION})
            updated = await c.until("session.updated")
            assert updated["session"]["tools"] == []

    asyncio.run(run())


# ---------------------------------------------------------------------------- item operations
def test_delete_engine_held_items(server: str) -> None:
    """Deleted user and assistant items are gone from the next prompt (echoed back)."""

    async def run() -> None:
        async with Client.connect(server) as c:
            await _text_session(c)
            await c.send(text_item("alpha question"))
            alpha = (await c.until("conversation.item.done"))["item"]["id"]
            first = (await _response(c))[-1]["response"]["output"][0]
            assert "alpha question" in first["content"][0]["text"]
            await c.send(text_item("beta question"))
            await c.until("conversation.item.done")
            second = (await _response(c))[-1]["response"]["output"][0]
            assert "alpha question" in second["content"][0]["text"]
            for item_id in (alpha, first["id"], second["id"]):
                await c.send({"type": "conversation.item.delete", "item_id": item_id})
                assert (await c.until("conversation.item.deleted"))["item_id"] == item_id
            await c.send(text_item("gamma"))
            third = (await _response(c))[-1]["response"]["output"][0]["content"][0]["text"]
            assert third == "beta question\ngamma"  # the prompt: the two user items left
            await c.send({"type": "conversation.item.retrieve", "item_id": alpha})
            assert (await c.until("error"))["error"]["code"] == "item_not_found"

    asyncio.run(run())


def test_delete_uncommitted_item(server: str) -> None:
    async def run() -> None:
        async with Client.connect(server) as c:
            await _text_session(c)
            await c.send(text_item("keep me"))
            await c.until("conversation.item.done")
            await c.send(text_item("drop me"))
            dropped = (await c.until("conversation.item.done"))["item"]["id"]
            await c.send({"type": "conversation.item.delete", "item_id": dropped})
            await c.until("conversation.item.deleted")
            text = (await _response(c))[-1]["response"]["output"][0]["content"][0]["text"]
            assert "keep me" in text and "drop me" not in text

    asyncio.run(run())


def test_out_of_band_response(server: str) -> None:
    async def run() -> None:
        async with Client.connect(server) as c:
            await _text_session(c)
            await c.send(text_item("in the conversation"))
            await c.until("conversation.item.done")
            oob = {
                "conversation": "none",
                "metadata": {"purpose": "classify"},
                "input": [
                    {
                        "type": "message",
                        "role": "user",
                        "content": [{"type": "input_text", "text": "only this"}],
                    }
                ],
            }
            events = await _response(c, oob)
            created = next(e for e in events if e["type"] == "response.created")
            assert created["response"]["metadata"] == {"purpose": "classify"}
            done = events[-1]["response"]
            assert done["metadata"] == {"purpose": "classify"}
            assert done["conversation_id"] is None
            assert done["output"][0]["content"][0]["text"] == "only this"
            assert "conversation.item.added" not in _kinds(events)  # not in the conversation
            # the pending input and the conversation are untouched by it
            text = (await _response(c))[-1]["response"]["output"][0]["content"][0]["text"]
            assert text == "in the conversation"
            bad = {"conversation": "conv_other"}
            await c.send({"type": "response.create", "response": bad})
            err = (await c.until("error"))["error"]
            assert (err["code"], err["param"]) == ("unsupported", "response.conversation")

    asyncio.run(run())


# ---------------------------------------------------------------------------- transcription
TRANSCRIPTION = {
    "type": "transcription",
    "audio": {"input": {"turn_detection": {"type": "server_vad", "silence_duration_ms": 300}}},
}


def test_transcription_session_raw_websocket(server: str) -> None:
    async def run() -> None:
        async with Client.connect(server) as c:
            await c.until("session.created")
            await c.send({"type": "session.update", "session": TRANSCRIPTION})
            assert (await c.until("session.updated"))["session"]["type"] == "transcription"
            await send_audio(c, silence(200) + tone(500) + silence(600))
            done = await c.until("conversation.item.input_audio_transcription.completed")
            assert done["transcript"] == "what is the weather like today"
            # manual commit too (once the input lane has taken the audio in)
            await send_audio(c, tone(300))
            await c.drain(0.3)
            await c.send({"type": "input_audio_buffer.commit"})
            await c.until("conversation.item.input_audio_transcription.completed")
            assert not any(e["type"].startswith("response.") for e in await c.drain(0.5))
            assert not any(e["type"].startswith("response.") for e in c.events)
            await c.send({"type": "response.create"})
            err = (await c.until("error"))["error"]
            assert (err["code"], err["param"]) == ("invalid_state", "type")

    asyncio.run(run())


PUSH_TO_TALK = {"type": "realtime", "audio": {"input": {"turn_detection": None}}}


@pytest.mark.parametrize("rate", [24000, 16000])
def test_a_commit_sent_right_after_the_audio_takes_all_of_it_and_keeps_its_place(
    server: str, rate: int
) -> None:
    """Push to talk as an OpenAI client does it: the appends, then at once the commit and a
    response.create. The commit covers every byte appended before it (the input lane's
    queue and what soxr still holds of 24 kHz input): a second commit finds nothing. The
    events after the commit wait behind it: committed comes before response.created. A
    clear sent the same way drops all of its audio."""

    async def run() -> None:
        async with Client.connect(server) as c:
            await c.until("session.created")
            fmt = {"type": "audio/pcm", "rate": rate}
            session = {**PUSH_TO_TALK, "audio": {"input": {"turn_detection": None, "format": fmt}}}
            await c.send({"type": "session.update", "session": session})
            await c.until("session.updated")
            await send_audio(c, tone(700, rate=rate), chunk_ms=20, rate=rate)
            await c.send({"type": "input_audio_buffer.commit"})
            await c.send({"type": "response.create"})
            await c.until("response.done")
            types = [e["type"] for e in c.events]
            assert "error" not in types, c.events
            assert types.index("input_audio_buffer.committed") < types.index("response.created")
            await c.drain(0.5)
            await c.send({"type": "input_audio_buffer.commit"})  # nothing was left behind
            assert (await c.until("error"))["error"]["code"] == "input_audio_buffer_commit_empty"
            await send_audio(c, tone(300, rate=rate), chunk_ms=20, rate=rate)
            await c.send({"type": "input_audio_buffer.clear"})
            await c.until("input_audio_buffer.cleared")
            await c.drain(0.5)
            await c.send({"type": "input_audio_buffer.commit"})  # the clear took it all
            assert (await c.until("error"))["error"]["code"] == "input_audio_buffer_commit_empty"

    asyncio.run(run())


def test_transcription_session_sdk(server: str) -> None:
    async def run() -> None:
        client = _sdk(server)
        async with client.realtime.connect(model="duplex") as conn:
            await conn.session.update(session=TRANSCRIPTION)  # type: ignore[arg-type]
            pcm = silence(200) + tone(500) + silence(600)
            for i in range(0, len(pcm), 1920):
                await conn.input_audio_buffer.append(audio=b64(pcm[i : i + 1920]))
            seen: list[str] = []
            async with asyncio.timeout(10 * UNIT):
                async for event in conn:
                    seen.append(event.type)
                    if event.type == "conversation.item.input_audio_transcription.completed":
                        assert event.transcript == "what is the weather like today"
                        break
            assert "session.updated" in seen and "input_audio_buffer.committed" in seen
            assert not any(kind.startswith("response.") for kind in seen)
        await client.close()

    asyncio.run(run())


# ---------------------------------------------------------------------------- idle timeout
async def _paced_silence(c: Client, seconds: float) -> None:
    """Silence in 40 ms appends for ``seconds`` of wall time (however late the loop runs)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        await c.send({"type": "input_audio_buffer.append", "audio": b64(silence(40))})
        await asyncio.sleep(0.04)


def test_idle_timeout_once_per_silence_not_while_speaking(server: str) -> None:
    async def run() -> None:
        async with Client.connect(server) as c:
            await c.until("session.created")
            td = {"type": "server_vad", "idle_timeout_ms": 400}
            update = {"audio": {"input": {"turn_detection": td}}}
            await c.send({"type": "session.update", "session": update})
            await c.until("session.updated")
            await _paced_silence(c, 0.6)  # no response yet: no timer
            await c.send(text_item("hello there, this question is long enough for the test"))
            done = (await _response(c))[-1]["response"]
            done_t = time.monotonic()
            audio_s = done["audio_ms"] / 1000
            assert audio_s > 0.8  # the reply's audio is still playing for a while
            start = len(c.events)
            # while the assistant speaks (its audio plays until done + audio_s): nothing
            await _paced_silence(c, done_t + audio_s - 0.3 - time.monotonic())
            assert "input_audio_buffer.timeout_triggered" not in _kinds(c.events[start:])
            await _paced_silence(c, 1.2)  # then one trigger and one prompting response
            await _paced_silence(c, 1.0)  # ... and not again in the same silence
            await c.drain(0.3)
            kinds = _kinds(c.events[start:])
            assert kinds.count("input_audio_buffer.timeout_triggered") == 1
            trig = kinds.index("input_audio_buffer.timeout_triggered")
            assert "response.created" in kinds[trig:]
            # the response that ends the trigger re-arms the timer: at most one more trigger
            # follows it, after its own audio (not within the 1 s after the first)

    asyncio.run(run())


# ---------------------------------------------------------------------------- noise reduction
@pytest.mark.parametrize("kind", [None, "near_field"])
def test_noise_reduction_runs_before_the_vad(server: str, kind: str | None) -> None:
    """beckett.wav in noise at 5 dB SNR, 16 kHz, through the server (energy VAD): without
    noise reduction the noise starts one endless turn, with it each phrase is a turn."""
    from bench.noise_reduction import PHRASES, beckett, mix, pcm16

    noisy = pcm16(mix(beckett(), 5.0))

    async def run() -> None:
        async with Client.connect(server) as c:
            await c.until("session.created")
            audio_in = {
                "format": {"type": "audio/pcm", "rate": 16000},
                "noise_reduction": None if kind is None else {"type": kind},
                "turn_detection": {"type": "server_vad", "create_response": False},
            }
            update = {"audio": {"input": audio_in}}
            await c.send({"type": "session.update", "session": update})
            got = (await c.until("session.updated"))["session"]["audio"]["input"]
            assert got["noise_reduction"] == (None if kind is None else {"type": kind})
            await send_audio(c, noisy, rate=16000)
            if kind is not None:
                for _ in PHRASES:
                    await c.until("input_audio_buffer.speech_stopped", within=10)
            await c.drain(1.0)
            starts = [
                e["audio_start_ms"]
                for e in c.events
                if e["type"] == "input_audio_buffer.speech_started"
            ]
            if kind is None:  # one turn from the first noise sample, never ended
                assert starts == [0]
                assert "input_audio_buffer.speech_stopped" not in _kinds(c.events)
            else:
                assert len(starts) == len(PHRASES) and starts[0] > 1500

    asyncio.run(run())


def test_transcription_session_live_partials(tmp_path: Path) -> None:
    """With the engine's live partials (pocketsphinx), a transcription session gets
    transcription deltas of the speech item while the user still speaks."""
    from bench.noise_reduction import beckett, pcm16

    speech = pcm16(beckett()[: 16000 * 3])  # "Ever tried. Ever failed." (~3 s)
    engine = {"partials": {"backend": "pocketsphinx"}}
    with running_server(write_config(tmp_path, engine=engine)) as addr:

        async def run() -> None:
            async with Client.connect(addr) as c:
                await c.until("session.created")
                session = {
                    **TRANSCRIPTION,
                    "audio": {
                        "input": {
                            "format": {"type": "audio/pcm", "rate": 16000},
                            "turn_detection": {"type": "server_vad", "silence_duration_ms": 1500},
                        }
                    },
                }
                await c.send({"type": "session.update", "session": session})
                await c.until("session.updated")
                for i in range(0, len(speech), 1280):  # 40 ms chunks in real time
                    await c.send(
                        {"type": "input_audio_buffer.append", "audio": b64(speech[i : i + 1280])}
                    )
                    await asyncio.sleep(0.04)
                await send_audio(c, silence(1800, rate=16000), rate=16000)
                stopped = await c.until("input_audio_buffer.speech_stopped", within=10)
                done = await c.until(
                    "conversation.item.input_audio_transcription.completed", within=10
                )
                live = [
                    e
                    for e in c.events[: c.events.index(stopped)]
                    if e["type"] == "conversation.item.input_audio_transcription.delta"
                ]
                assert live and all(e["item_id"] == done["item_id"] for e in live)
                # pocketsphinx's rough live words ("there" for "ever tried" was seen)
                assert "".join(e["delta"] for e in live).strip()

        asyncio.run(run())
