"""The real server on a config whose stages run on the batching runtime (test-batch):
concurrent sessions over real sockets are served in shared steps, and /metrics shows it."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

from tests.server.harness import Client, http_text, running_server, text_item, write_config

BATCHED = {
    "stages": {
        name: {"backend": "test-batch", "options": {"step_s": 0.01, "chunk_ms": 40.0}}
        for name in ("asr", "llm", "tts")
    }
}


def test_sessions_share_batched_steps_over_real_sockets(tmp_path: Path) -> None:
    with running_server(write_config(tmp_path, engine=BATCHED)) as server:

        async def one(i: int) -> str:
            async with Client.connect(server) as c:
                await c.until("session.created")
                await c.send(text_item(f"hello {i}"))
                await c.send({"type": "response.create"})
                done = await c.until("response.done", within=20.0)
                assert done["response"]["status"] == "completed", done
                audio = [e for e in c.events if e["type"] == "response.output_audio.delta"]
                assert audio
                return str(done["response"]["id"])

        async def run() -> list[str]:
            return list(await asyncio.gather(*(one(i) for i in range(4))))

        assert len(set(asyncio.run(run()))) == 4
        body = http_text(server, "/metrics")
        counts = {
            m.group(1): float(m.group(2))
            for m in re.finditer(
                r'duplex_stage_batch_size_count\{stage="(\w+)"\} ([0-9.e+]+)', body
            )
        }
        assert counts.get("llm", 0) > 0 and counts.get("tts", 0) > 0, counts
        # some steps carried more than one session's request
        ones = re.search(
            r'duplex_stage_batch_size_bucket\{le="1.0",stage="llm"\} ([0-9.e+]+)', body
        )
        assert ones is not None and float(ones.group(1)) < counts["llm"], body[-2000:]
        # every request's wait for its first step, per stage (engine/stage_figures.py)
        waits = {
            m.group(1): float(m.group(2))
            for m in re.finditer(
                r'duplex_stage_queue_wait_seconds_count\{stage="(\w+)"\} ([0-9.e+]+)', body
            )
        }
        assert waits.get("llm", 0) >= 4 and waits.get("tts", 0) >= 4, waits  # text turns: no asr
        waited = re.search(r'duplex_stage_queue_wait_seconds_sum\{stage="tts"\} ([0-9.e+]+)', body)
        assert waited is not None and float(waited.group(1)) > 0
        for stage in ("asr", "llm", "tts"):  # no worker died
            assert f'duplex_stage_restarts_total{{stage="{stage}"}} 0.0' in body
