"""CLI options are accepted before and after the subcommand (no server needed)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from duplex_client.cli import DEFAULT_URL, build_parser, main, url_problem


def test_url_after_the_subcommand() -> None:
    args = build_parser().parse_args(["talk", "--url", "ws://x/v1/realtime", "--wav", "a.wav"])
    assert args.url == "ws://x/v1/realtime"


def test_url_before_the_subcommand_and_default() -> None:
    parser = build_parser()
    assert parser.parse_args(["--url", "ws://y", "chat", "hi"]).url == "ws://y"
    assert parser.parse_args(["chat", "hi"]).url == DEFAULT_URL
    after = parser.parse_args(["--url", "ws://y", "say", "hi", "--out", "o", "--url", "ws://z"])
    assert after.url == "ws://z"  # the later, subcommand option wins
    keyed = parser.parse_args(["say", "hi", "--out", "o", "--api-key", "k"])
    assert keyed.api_key == "k"


def test_url_mistakes_get_one_line_with_the_fix(capsys: pytest.CaptureFixture[str]) -> None:
    assert url_problem("ws://127.0.0.1:8000/v1/realtime") is None
    assert url_problem("wss://voice.example.com/v1/duplex?model=x") is None
    assert url_problem("http://127.0.0.1:8000/v1/realtime") == (
        "--url 'http://127.0.0.1:8000/v1/realtime' is an HTTP URL; the realtime socket is a "
        "WebSocket: --url ws://127.0.0.1:8000/v1/realtime"
    )
    assert url_problem("https://h/").endswith("--url wss://h/v1/realtime")
    assert url_problem("ws://127.0.0.1:8000").endswith(  # type: ignore[union-attr]
        "names no realtime endpoint (/v1/realtime): --url ws://127.0.0.1:8000/v1/realtime"
    )
    assert "is not a WebSocket URL" in (url_problem("127.0.0.1:8000") or "")
    assert main(["--url", "http://127.0.0.1:8000", "chat", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--url ws://127.0.0.1:8000/v1/realtime" in err


def test_nothing_listening_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    assert main(["--url", f"ws://127.0.0.1:{port}/v1/realtime", "chat", "hi"]) == 1
    err = capsys.readouterr().err
    assert (
        err
        == f"duplex-client: nothing listens at 127.0.0.1:{port} (start the server: make serve)\n"
    )


def test_offer_says_what_it_wrote(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "offer.sdp"
    assert main(["offer", "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert said.startswith(f"wrote {out}: an SDP offer (") and "/v1/realtime/calls" in said
    assert out.read_text().startswith("v=0") and "m=audio" in out.read_text()
