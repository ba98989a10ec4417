"""The OpenAI-compatible batch routes against the real server on loopback (test stage)."""

from __future__ import annotations

import base64
import io
import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile

from tests.server.harness import UNIT, running_server, write_config

BECKETT = Path(__file__).resolve().parents[1] / "data" / "beckett.wav"
TEST_TRANSCRIPT = "what is the weather like today"  # configs/test.yaml's ASR


def _post(addr: str, path: str, **kw: Any) -> httpx.Response:
    return httpx.post(f"http://{addr}{path}", timeout=30 * UNIT, **kw)


def _error(resp: httpx.Response, status: int, param: str | None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err: dict[str, Any] = resp.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param
    assert set(err) == {"message", "type", "param", "code"}
    return err


def _pcm_of(data: bytes) -> np.ndarray:
    samples, rate = soundfile.read(io.BytesIO(data), dtype="int16")
    assert rate == 24000
    return np.asarray(samples)


def _sse(resp: httpx.Response) -> list[str]:
    return [line[6:] for line in resp.text.split("\n") if line.startswith("data: ")]


def test_models(server: str) -> None:
    data = httpx.get(f"http://{server}/v1/models", timeout=5 * UNIT).json()
    assert data["object"] == "list"
    assert data["data"][0] == {
        "id": "duplex",
        "object": "model",
        "created": 0,
        "owned_by": "duplex-server",
    }


def test_speech_every_format_decodes_to_the_same_audio(server: str) -> None:
    body = {"model": "tts-1", "input": "Hello there, how are you today?", "voice": "alloy"}
    pcm = _post(server, "/v1/audio/speech", json={**body, "response_format": "pcm"})
    assert pcm.status_code == 200 and pcm.headers["content-type"] == "audio/pcm"
    ref = np.frombuffer(pcm.content, dtype="<i2")
    assert ref.size > 24000 * 0.5  # the test TTS speaks 250 ms per word
    for fmt, mime in (("wav", "audio/wav"), ("flac", "audio/flac")):
        resp = _post(server, "/v1/audio/speech", json={**body, "response_format": fmt})
        assert resp.status_code == 200 and resp.headers["content-type"] == mime
        assert np.array_equal(_pcm_of(resp.content), ref)  # lossless: bit-exact
    opus = _post(server, "/v1/audio/speech", json={**body, "response_format": "opus"})
    assert opus.content[:4] == b"OggS" and b"OpusHead" in opus.content[:100]
    decoded = _pcm_of(opus.content)
    assert abs(decoded.size - ref.size) < 24000 * 0.1  # lossy, same length within 100 ms
    mp3 = _post(server, "/v1/audio/speech", json={**body, "response_format": "mp3"})
    assert mp3.headers["content-type"] == "audio/mpeg"
    head = mp3.content[:2]
    assert head[0] == 0xFF and head[1] & 0xE0 == 0xE0  # an MPEG frame sync


def test_speech_default_format_is_mp3_and_streams_in_chunks(server: str) -> None:
    body = {"model": "tts-1", "input": " ".join(["word"] * 40), "response_format": "wav"}
    with httpx.stream(
        "POST", f"http://{server}/v1/audio/speech", json=body, timeout=30 * UNIT
    ) as resp:
        assert resp.status_code == 200
        assert resp.headers.get("transfer-encoding") == "chunked"
        chunks = list(resp.iter_raw())
    data = b"".join(chunks)
    assert len(chunks) > 1
    assert data[4:8] == b"\xff\xff\xff\xff"  # streamed WAV: length unknown marker
    assert _pcm_of(data).size == 40 * 24000 * 250 // 1000
    default = _post(server, "/v1/audio/speech", json={"model": "m", "input": "hi"})
    assert default.headers["content-type"] == "audio/mpeg"


def test_speech_sse(server: str) -> None:
    body = {
        "model": "m",
        "input": "one two three",
        "response_format": "pcm",
        "stream_format": "sse",
    }
    resp = _post(server, "/v1/audio/speech", json=body)
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(d) for d in _sse(resp)]
    assert {e["type"] for e in events[:-1]} == {"speech.audio.delta"}
    assert events[-1]["type"] == "speech.audio.done"
    assert events[-1]["usage"]["input_tokens"] == 3
    audio = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    assert len(audio) == 3 * 24000 * 2 * 250 // 1000


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"model": "m", "input": "hi", "response_format": "ogg"}, "response_format", None),
        ({"model": "m", "input": "hi", "response_format": "aac"}, "response_format", None),
        ({"model": "m", "input": "hi", "speed": 9}, "speed", "invalid_value"),
        ({"model": "m", "input": ""}, "input", "invalid_value"),
        ({"model": "m"}, "input", "missing_required_parameter"),
        ({"model": "m", "input": "hi", "pitch": 2}, "pitch", "unknown_parameter"),
        ({"model": "m", "input": "hi", "stream_format": "ws"}, "stream_format", None),
    ],
)
def test_speech_validation(server: str, body: dict[str, Any], param: str, code: str | None) -> None:
    err = _error(_post(server, "/v1/audio/speech", json=body), 400, param)
    assert param in err["message"]
    if code is not None:
        assert err["code"] == code


def test_invalid_json_and_oversize_body(server: str) -> None:
    resp = _post(
        server,
        "/v1/audio/speech",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert _error(resp, 400, None)["code"] == "invalid_json"
    big = b"x" * (25 * 1024 * 1024 + 1)
    resp = _post(server, "/v1/audio/transcriptions", files={"file": ("a.wav", big)})
    assert _error(resp, 413, None)["code"] == "request_too_large"


def test_chat_text(server: str) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    data = _post(server, "/v1/chat/completions", json=body).json()
    assert data["object"] == "chat.completion"
    msg = data["choices"][0]["message"]
    assert msg["content"].startswith("Hello there.")
    assert "audio" not in msg
    assert data["choices"][0]["finish_reason"] == "stop"
    assert data["usage"]["completion_tokens"] > 0


def test_chat_audio_non_streaming(server: str) -> None:
    body = {
        "model": "m",
        "modalities": ["text", "audio"],
        "audio": {"voice": "alloy", "format": "wav"},
        "messages": [
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": "hi"},
        ],
    }
    msg = _post(server, "/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert msg["audio"]["id"].startswith("audio_")
    assert msg["audio"]["transcript"] == msg["content"]
    pcm = _pcm_of(base64.b64decode(msg["audio"]["data"]))
    assert pcm.size == len(msg["content"].split(" ")) * 24000 * 250 // 1000


def test_chat_stream_with_audio_and_usage(server: str) -> None:
    body = {
        "model": "m",
        "stream": True,
        "stream_options": {"include_usage": True},
        "modalities": ["text", "audio"],
        "audio": {"voice": "alloy", "format": "pcm16"},
        "messages": [{"role": "user", "content": "hi"}],
    }
    resp = _post(server, "/v1/chat/completions", json=body)
    data = _sse(resp)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    text = "".join(d.get("content", "") for d in deltas)
    audio = b"".join(base64.b64decode(d["audio"]["data"]) for d in deltas if "audio" in d)
    assert text.startswith("Hello there.")
    assert len(audio) == len(text.split(" ")) * 24000 * 2 * 250 // 1000
    finals = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finals[-1] == "stop" and set(finals[:-1]) == {None}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] > 0


def test_chat_with_input_audio_goes_through_asr(server: str) -> None:
    wav = base64.b64encode(BECKETT.read_bytes()).decode()
    content = [{"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}}]
    body = {"model": "m", "messages": [{"role": "user", "content": content}]}
    assert _post(server, "/v1/chat/completions", json=body).status_code == 200


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m", "messages": []}, "messages"),
        ({"model": "m", "messages": [{"role": "tool", "content": "x"}]}, "messages.0.role"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": []}, "tools"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
        (
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "modalities": ["audio"]},
            "audio",
        ),
        (
            {
                "model": "m",
                "messages": [{"role": "user", "content": "x"}],
                "modalities": ["text", "audio"],
                "audio": {"voice": "a", "format": "aac"},
            },
            "audio.format",
        ),
    ],
)
def test_chat_validation(server: str, body: dict[str, Any], param: str) -> None:
    _error(_post(server, "/v1/chat/completions", json=body), 400, param)


def _flac_and_opus() -> dict[str, bytes]:
    samples, rate = soundfile.read(BECKETT, dtype="float32")
    out = {"wav": BECKETT.read_bytes()}
    for name, fmt, subtype in (("flac", "FLAC", "PCM_16"), ("ogg", "OGG", "OPUS")):
        buf = io.BytesIO()
        soundfile.write(buf, samples, rate, format=fmt, subtype=subtype)
        out[name] = buf.getvalue()
    return out


def test_transcriptions_formats(server: str) -> None:
    for ext, data in _flac_and_opus().items():
        files = {"file": (f"speech.{ext}", data)}
        resp = _post(server, "/v1/audio/transcriptions", files=files, data={"model": "whisper-1"})
        assert resp.status_code == 200, resp.text
        assert resp.json()["text"] == TEST_TRANSCRIPT
    files = {"file": ("speech.wav", BECKETT.read_bytes())}
    text = _post(
        server,
        "/v1/audio/transcriptions",
        files=files,
        data={"model": "m", "response_format": "text"},
    )
    assert text.text == TEST_TRANSCRIPT + "\n"
    verbose = _post(
        server,
        "/v1/audio/transcriptions",
        files=files,
        data={"model": "m", "response_format": "verbose_json", "language": "en"},
    ).json()
    assert verbose["text"] == TEST_TRANSCRIPT
    assert abs(verbose["duration"] - 9.963) < 0.01
    assert verbose["segments"][0]["end"] == verbose["duration"]


def test_transcriptions_errors(server: str) -> None:
    wav = {"file": ("a.wav", BECKETT.read_bytes())}
    path = "/v1/audio/transcriptions"
    srt = _post(server, path, files=wav, data={"model": "m", "response_format": "srt"})
    assert _error(srt, 400, "response_format")["code"] == "unsupported_value"
    _error(_post(server, path, files=wav), 400, "model")
    _error(_post(server, path, data={"model": "m"}), 400, "file")
    _error(_post(server, path, files=wav, data={"model": "m", "foo": "1"}), 400, "foo")
    garbage = {"file": ("a.wav", b"RIFF not really audio")}
    assert _error(_post(server, path, files=garbage, data={"model": "m"}), 400, "file")["code"] == (
        "invalid_file"
    )
    text = {"file": ("notes.txt", b"these are my notes, not audio\n" * 20)}
    err = _error(_post(server, path, files=text, data={"model": "m"}), 400, "file")
    assert err["code"] == "invalid_file"
    assert err["message"] == (
        "cannot decode audio (Format not recognised); send WAV, FLAC, MP3 or Ogg (Vorbis, "
        "Opus) audio"
    )  # no Python repr such as <_io.BytesIO object at 0x...>


def test_openai_sdk_against_the_server(server: str) -> None:
    import openai

    client = openai.OpenAI(base_url=f"http://{server}/v1", api_key="unused", max_retries=0)
    speech = client.audio.speech.create(
        model="tts-1", voice="alloy", input="hello world", response_format="wav"
    )
    assert _pcm_of(speech.content).size == 2 * 24000 * 250 // 1000
    chat = client.chat.completions.create(
        model="gpt-4o-audio-preview",
        modalities=["text", "audio"],
        audio={"voice": "alloy", "format": "wav"},
        messages=[{"role": "user", "content": "hi"}],
    )
    assert chat.choices[0].message.audio is not None
    assert chat.choices[0].message.audio.transcript.startswith("Hello there.")
    stream = client.chat.completions.create(
        model="m", stream=True, messages=[{"role": "user", "content": "hi"}]
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text.startswith("Hello there.")
    with BECKETT.open("rb") as f:
        tr = client.audio.transcriptions.create(model="whisper-1", file=f)
    assert tr.text == TEST_TRANSCRIPT
    with pytest.raises(openai.BadRequestError) as info:
        client.audio.speech.create(
            model="tts-1",
            voice="alloy",
            input="x",
            response_format="aac",  # not one of ours
        )
    assert info.value.param == "response_format"


def test_configured_body_limit_and_model_aliases(tmp_path: Path) -> None:
    """``server.batch`` in the YAML reaches the routes: body limit (413) and /v1/models."""
    cfg = write_config(
        tmp_path, server={"batch": {"max_body_bytes": 1000, "model_aliases": ["tts-1"]}}
    )
    with running_server(cfg) as addr:
        big = json.dumps({"model": "tts-1", "input": "x" * 2000, "voice": "alloy"}).encode()
        req = urllib.request.Request(
            f"http://{addr}/v1/audio/speech", data=big, headers={"Content-Type": "application/json"}
        )
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req, timeout=10)
        assert info.value.code == 413
        body = json.loads(info.value.read())
        assert body["error"]["type"] == "invalid_request_error"
        with urllib.request.urlopen(f"http://{addr}/v1/models", timeout=10) as r:
            ids = [m["id"] for m in json.loads(r.read())["data"]]
        assert ids == ["duplex", "tts-1"]


def _count(addr: str, route: str, status: str) -> float:
    text = httpx.get(f"http://{addr}/metrics", timeout=10 * UNIT).text
    key = f'duplex_batch_request_seconds_count{{route="{route}",status="{status}"}} '
    return next(
        (float(line.split()[-1]) for line in text.splitlines() if line.startswith(key)), 0.0
    )


def test_batch_latency_is_exported(server: str) -> None:
    before_ok = _count(server, "/v1/audio/speech", "200")
    before_bad = _count(server, "/v1/audio/speech", "400")
    ok = _post(server, "/v1/audio/speech", json={"model": "m", "input": "Hi.", "voice": "test"})
    assert ok.status_code == 200
    bad = _post(server, "/v1/audio/speech", json={"model": "m", "input": "", "voice": "test"})
    assert bad.status_code == 400
    assert _count(server, "/v1/audio/speech", "200") == before_ok + 1
    assert _count(server, "/v1/audio/speech", "400") == before_bad + 1
