"""The README's "60-second tour", run as written against a real server on 127.0.0.1.

The tour's code blocks are read from README.md (so a changed command is tested as changed):
its shell commands (indented blocks; ``make wscat`` with the JSON lines after it typed in)
and its Python blocks, each run in a scratch directory against the test server
(configs/test.yaml: deterministic test stages, no model needed): ``127.0.0.1:8000`` in the
text and ``DUPLEX_URL`` (the CLI's default) point at it, ``.venv/bin/`` at this
interpreter's. The Twilio TwiML block needs a phone number and is only checked for its
shape.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server.harness import ROOT, UNIT, running_server, write_config

README = ROOT / "README.md"
BIN = Path(sys.executable).parent
#: the test LLM answers a forced call of get_weather with these arguments (the SDK sample)
LLM = {
    "backend": "test",
    "options": {"tool_arguments": {"get_weather": '{"city": "Paris"}'}},
}


def tour() -> list[tuple[str, str]]:
    """``(kind, text)`` of each code block of the tour: kind is ``shell`` (an indented
    block), or the fence's language (``python``, ``json``, ``xml``)."""
    text = README.read_text()
    start = text.index("## 60-second tour")
    section = text[start : text.index("\n## ", start + 1)]
    blocks: list[tuple[str, str]] = []
    lines = section.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            lang, body = line[3:].strip(), []
            i += 1
            while not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            blocks.append((lang, "\n".join(body)))
        elif line.startswith("    ") and (i == 0 or not lines[i - 1].strip()):
            body = []
            while i < len(lines) and (lines[i].startswith("    ") or not lines[i].strip()):
                body.append(lines[i][4:])
                i += 1
            blocks.append(("shell", "\n".join(body).strip()))
            continue
        i += 1
    return blocks


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    path = write_config(tmp_path_factory.mktemp("tour"), engine={"stages": {"llm": LLM}})
    with running_server(Path(path)) as addr:
        yield addr


@pytest.fixture
def scratch(tmp_path: Path) -> Path:
    """A directory like a checkout for the commands: ``tests/`` from the repository."""
    (tmp_path / "tests").symlink_to(ROOT / "tests")
    return tmp_path


def _as_here(text: str, addr: str) -> str:
    return text.replace("127.0.0.1:8000", addr).replace(".venv/bin/", f"{BIN}/")


def _run(cmd: str, cwd: Path, addr: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("DUPLEX_API_KEY", None)
    env["DUPLEX_URL"] = f"ws://{addr}/v1/realtime"  # the CLI's default, 127.0.0.1:8000
    return subprocess.run(
        ["bash", "-c", _as_here(cmd, addr)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=90 * UNIT,
    )


def test_the_tour_has_the_blocks_this_test_runs() -> None:
    kinds = [kind for kind, _ in tour()]
    assert kinds.count("python") == 3 and kinds.count("json") == 1 and "xml" in kinds
    shell = "\n".join(text for kind, text in tour() if kind == "shell")
    for command in (
        "duplex-client offer",
        "/v1/realtime/calls",
        "make wscat",
        "duplex-client talk",
    ):
        assert command in shell
    assert "npx wscat" not in README.read_text()  # it would download wscat unasked


def test_shell_commands(server: str, scratch: Path) -> None:
    """Every indented command block but ``make wscat`` (below), in order: the WebRTC offer
    and its 201 answer, the CLI (talk, say, chat) and the batch curl commands."""
    blocks = [t for kind, t in tour() if kind == "shell" and t.strip() != "make wscat"]
    outputs: list[str] = []
    for block in blocks:
        commands = re.sub(r"\\\n\s*", "", block).splitlines()
        for command in commands:
            result = _run(command, scratch, server)
            assert result.returncode == 0, (command, result.stdout, result.stderr)
            outputs.append(result.stdout)
    joined = "\n".join(outputs)
    sdp = next(o for o in outputs if o.startswith("v=0"))  # the curl's SDP answer
    assert "m=audio" in sdp and "webrtc-datachannel" in sdp
    assert (scratch / "offer.sdp").read_text().startswith("v=0")
    assert "turns detected by server VAD" in joined and "TTFA" in joined  # talk
    assert "one spoken turn" not in joined
    assert (scratch / "reply.wav").stat().st_size > 44
    assert (scratch / "hello.wav").read_bytes()[:4] == b"RIFF"  # say, then curl
    assert "assistant> Hello there." in joined  # chat
    transcript = next(o for o in outputs if o.startswith('{"text"'))
    assert json.loads(transcript)["text"] == "what is the weather like today"
    models = json.loads(outputs[-1])
    assert models["object"] == "list" and models["data"]


@pytest.mark.skipif(shutil.which("npm") is None, reason="make wscat needs npm")
def test_make_wscat_with_the_tour_lines(server: str) -> None:
    """``make wscat`` (installing the pinned wscat if clients/node_modules/ lacks it), then the
    tour's JSON lines typed in: a text answer comes back."""
    lines = next(t for kind, t in tour() if kind == "json").splitlines()
    host, port = server.rsplit(":", 1)
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "DUPLEX_API_KEY")}
    proc = subprocess.Popen(
        ["make", "-s", "-C", str(ROOT), "wscat", f"HOST={host}", f"PORT={port}"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    assert proc.stdin is not None and proc.stdout is not None
    seen: list[str] = []
    deadline = time.monotonic() + 120 * UNIT  # the first run installs wscat

    def read_until(kind: str) -> None:
        assert proc.stdout is not None
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                raise AssertionError(f"make wscat ended; saw {seen}")
            start = line.find("{")
            if start >= 0:
                seen.append(json.loads(line[start:])["type"])
                if seen[-1] == kind:
                    return
        raise AssertionError(f"no {kind}; saw {seen}")

    try:
        read_until("session.created")
        for line in lines:
            proc.stdin.write(line + "\n")
            proc.stdin.flush()
        read_until("response.done")
        assert "response.output_text.delta" in seen and "error" not in seen, seen
    finally:
        proc.stdin.close()
        proc.terminate()
        proc.wait(5 * UNIT)
        proc.stdout.close()


def test_python_blocks(server: str, scratch: Path) -> None:
    """The SDK sample, the OpenAI SDK's HTTP sample and its realtime tool-call sample."""
    sdk, http, tools = (t for kind, t in tour() if kind == "python")
    outputs = []
    for code in (sdk, http, tools):
        result = subprocess.run(
            [sys.executable, "-c", _as_here(code, server)],
            cwd=scratch,
            capture_output=True,
            text=True,
            timeout=60 * UNIT,
        )
        assert result.returncode == 0, (code, result.stderr)
        outputs.append(result.stdout)
    assert outputs[0].startswith("Hello there.")
    assert (scratch / "hi.mp3").stat().st_size > 0
    assert outputs[1].splitlines()[-1] == "what is the weather like today"
    call, answer = outputs[2].splitlines()[:2]
    assert call == "get_weather {'city': 'Paris'}"
    assert answer and not answer.startswith("{")  # text after the tool result, not a call


def test_twiml_block_names_the_twilio_route() -> None:
    xml = next(t for kind, t in tour() if kind == "xml")
    assert "<Connect><Stream url=" in xml and "/v1/twilio" in xml
