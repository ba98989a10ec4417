"""The remote talker's stream handling against a scripted server (httpx.MockTransport): the
request body, whole frames out, and the failures a server without the logits processor or a
cut stream cause (the real `vllm serve` runs in tests/vllm/test_talker_remote.py)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from duplex_contract.errors import ConfigError, StageError
from engine.codec_layout import ORPHEUS
from engine.messages import StageDone, TokensOut, TtsRequest
from engine.stages.talker_remote import RemoteTalker, RemoteTalkerOptions

F = ORPHEUS.frame_size


def _tokenizer(tmp_path: Path) -> Path:
    vocab = {"[UNK]": 0, "tara:": 1, "hi": 2, "there.": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    return tmp_path


def _tokens(frames: int, *, bad_at: int | None = None) -> list[int]:
    out = []
    for i in range(frames * F):
        lo = ORPHEUS.position_range(i % F).start
        out.append(0 if i == bad_at else lo + (i * 37) % ORPHEUS.codebook_size)
    return out


def _sse(chunks: list[list[int]], reason: str = "length", done: bool = True) -> bytes:
    lines = []
    for i, ids in enumerate(chunks):
        last = i == len(chunks) - 1
        choice = {
            "index": 0,
            "text": "",
            "token_ids": ids,
            "finish_reason": reason if last else None,
        }
        lines.append(f"data: {json.dumps({'choices': [choice]})}\n\n")
    if done:
        lines.append("data: [DONE]\n\n")
    return "".join(lines).encode()


def _run(tmp_path: Path, body: bytes, **over: Any) -> tuple[list[Any], list[dict[str, Any]]]:
    seen: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    async def go() -> list[Any]:
        opts = RemoteTalkerOptions(
            base_url="http://talker/v1", tokenizer=str(_tokenizer(tmp_path)), retries=0, **over
        )
        talker = RemoteTalker(opts, "talker")
        await talker.start()
        talker.connection._client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        out: list[Any] = []
        try:
            async for item in talker.submit(
                TtsRequest(request_id="s/e0/t1/talker", text="hi there.")
            ):
                out.append(item)
        except StageError as exc:
            out.append(exc)
        finally:
            await talker.close()
        return out

    return asyncio.run(go()), seen


def test_the_body_asks_for_token_ids_and_the_processor(tmp_path: Path) -> None:
    tokens = _tokens(2)
    out, seen = _run(tmp_path, _sse([tokens[:3], tokens[3:12], tokens[12:]]), seed=7, max_frames=2)
    (body,) = seen
    assert body["prompt"][: len(ORPHEUS.prompt_prefix)] == list(ORPHEUS.prompt_prefix)
    assert body["prompt"][-len(ORPHEUS.prompt_suffix) :] == list(ORPHEUS.prompt_suffix)
    assert body["return_token_ids"] is True and body["stream"] is True
    assert body["vllm_xargs"] == {
        "codec_frames": [ORPHEUS.audio_base, ORPHEUS.codebook_size, F, *ORPHEUS.end_ids]
    }
    assert body["stop_token_ids"] == list(ORPHEUS.end_ids)
    assert body["max_tokens"] == 2 * F and body["stream_interval"] == F
    assert isinstance(body["seed"], int)
    # whole frames only, whatever the chunking: 3 + 9 + 2 tokens -> two frames of 7 codes
    frames = [o for o in out if isinstance(o, TokensOut)]
    assert [len(f.ids) for f in frames] == [F, F]
    assert list(frames[0].ids) == ORPHEUS.tokens_to_codes(tokens[:F])
    assert isinstance(out[-1], StageDone) and out[-1].tokens == 2 * F


def test_a_token_outside_its_codebook_names_the_missing_processor(tmp_path: Path) -> None:
    out, _ = _run(tmp_path, _sse([_tokens(2, bad_at=9)]))
    assert isinstance(out[-1], StageError) and "--logits-processors" in str(out[-1])
    assert [len(o.ids) for o in out if isinstance(o, TokensOut)] == [F]  # the good frame only


def test_a_stop_mid_frame_or_a_cut_stream_fails_the_request(tmp_path: Path) -> None:
    out, _ = _run(tmp_path, _sse([_tokens(1)[:5]], reason="stop"))
    assert isinstance(out[-1], StageError) and "5 codes into a frame" in str(out[-1])
    out, _ = _run(tmp_path, _sse([_tokens(1)], done=False))
    assert isinstance(out[-1], StageError) and "without [DONE]" in str(out[-1])


def test_a_missing_tokenizer_is_a_config_error(tmp_path: Path) -> None:
    talker = RemoteTalker(
        RemoteTalkerOptions(base_url="http://x/v1", tokenizer=str(tmp_path)), "talker"
    )
    with pytest.raises(ConfigError, match=r"tokenizer: no tokenizer\.json"):
        asyncio.run(talker.start())
