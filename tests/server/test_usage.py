"""Usage on ``response.done``, in ``session.closed`` and in /metrics add up to what the client
sent and received: a real server (configs/test.yaml: its LLM's tokens are words) and a real
WebSocket client (docs/protocol.md §5.11)."""

from __future__ import annotations

import asyncio
import base64
import logging
import math
import re
from pathlib import Path
from typing import Any

import pytest

from tests.server.harness import (
    UNIT,
    Client,
    http_text,
    running_server,
    send_audio,
    tone,
    write_config,
)

INSTRUCTIONS = "Answer the caller in a few words."
HEARD = "what is the weather like today"  # configs/test.yaml's ASR transcript


def words(text: str) -> int:
    return len(text.split())


def received_seconds(events: list[dict[str, Any]], response_id: str) -> float:
    """The audio of ``response_id`` the client received (PCM16 24 kHz deltas)."""
    n = sum(
        len(base64.b64decode(e["delta"]))
        for e in events
        if e["type"] == "response.output_audio.delta" and e["response_id"] == response_id
    )
    return n / 2 / 24000


def check_shape(usage: dict[str, Any]) -> None:
    i, o = usage["input_token_details"], usage["output_token_details"]
    assert usage["input_tokens"] == i["text_tokens"] + i["audio_tokens"]
    assert usage["output_tokens"] == o["text_tokens"] + o["audio_tokens"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert i["cached_tokens"] == 0


async def turn(c: Client, seconds: float) -> dict[str, Any]:
    """``seconds`` of 16 kHz audio, committed and answered; the finished response."""
    await send_audio(c, tone(seconds * 1000, rate=16000), rate=16000)
    # a commit takes the audio the input lane has processed so far (as in test_turns.py's
    # manual commit): let the lane catch up first
    await asyncio.sleep(0.3 * UNIT)
    await c.send({"type": "input_audio_buffer.commit"})
    await c.send({"type": "response.create"})
    done = await c.until("response.done", within=10)
    assert done["response"]["status"] == "completed"
    response: dict[str, Any] = done["response"]
    return response


def metric(body: str, name: str, kind: str) -> float:
    m = re.search(rf'^{name}{{kind="{kind}"}} (\S+)$', body, re.M)
    assert m is not None, f"{name}{{kind={kind}}} missing"
    return float(m.group(1))


def test_usage_adds_up_to_what_was_sent_and_spoken(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = write_config(tmp_path)
    caplog.set_level(logging.INFO, logger="duplex_server.session.live")

    async def run(addr: str) -> dict[str, Any]:
        async with Client.connect(addr) as c:
            await c.until("session.created")
            session = {
                "instructions": INSTRUCTIONS,
                "audio": {
                    "input": {
                        "format": {"type": "audio/pcm", "rate": 16000},
                        "turn_detection": None,
                    }
                },
            }
            await c.send({"type": "session.update", "session": session})
            await c.until("session.updated")
            answers: list[str] = []
            totals: dict[str, float] = dict.fromkeys(("in_text", "out_text", "out_audio"), 0)
            for n, seconds in enumerate((1.2, 0.6)):
                resp = await turn(c, seconds)
                usage = resp["usage"]
                check_shape(usage)
                i, o = usage["input_token_details"], usage["output_token_details"]
                # input: the audio committed for this response, at 10 tokens a second
                assert usage["input_audio_seconds"] == seconds
                assert i["audio_tokens"] == round(seconds * 10)
                # ... and the prompt: instructions, the history so far and the new words
                prompt = [INSTRUCTIONS, *[w for a in answers for w in (HEARD, a)], HEARD]
                assert i["text_tokens"] == sum(map(words, prompt)), n
                # output: the answer's tokens, and the audio the client received
                answer = resp["output"][0]["content"][0]["transcript"]
                assert o["text_tokens"] == words(answer) > 0
                got = received_seconds(c.events, resp["id"])
                assert got > 0 and abs(usage["output_audio_seconds"] - got) <= 0.001
                assert usage["output_audio_seconds"] * 1000 == resp["audio_ms"]
                assert o["audio_tokens"] == math.ceil(round(got * 20, 3))
                answers.append(answer)
                totals["in_text"] += i["text_tokens"]
                totals["out_text"] += o["text_tokens"]
                totals["out_audio"] += o["audio_tokens"]
            await c.send({"type": "session.close"})
            closed = await c.until("session.closed")
            total: dict[str, Any] = closed["usage"]
            check_shape(total)
            assert total["responses"] == 2
            assert total["input_audio_seconds"] == 1.8  # everything the client sent
            assert total["input_token_details"]["audio_tokens"] == 18
            assert total["input_token_details"]["text_tokens"] == totals["in_text"]
            assert total["output_token_details"]["text_tokens"] == totals["out_text"]
            assert total["output_token_details"]["audio_tokens"] == totals["out_audio"]
            spoken = sum(
                e["response"]["usage"]["output_audio_seconds"]
                for e in c.events
                if e["type"] == "response.done"
            )
            assert abs(total["output_audio_seconds"] - spoken) <= 0.001
            return total

    with running_server(path) as addr:
        total = asyncio.run(run(addr))
        body = http_text(addr, "/metrics")
    i, o = total["input_token_details"], total["output_token_details"]
    for kind, n in (
        ("input_text", i["text_tokens"]),
        ("input_audio", i["audio_tokens"]),
        ("input_cached", 0),
        ("output_text", o["text_tokens"]),
        ("output_audio", o["audio_tokens"]),
    ):
        assert metric(body, "duplex_usage_tokens_total", kind) == n, kind
    assert abs(metric(body, "duplex_usage_audio_seconds_total", "input") - 1.8) < 1e-6
    out = metric(body, "duplex_usage_audio_seconds_total", "output")
    assert abs(out - total["output_audio_seconds"]) <= 0.001
    # the log keeps the session's totals too (a media call's events reach no client)
    (line,) = [r.getMessage() for r in caplog.records if ": closed (client): " in r.getMessage()]
    assert "2 responses" in line and "audio 1.8 s in" in line
