"""CLI options are accepted before and after the subcommand (no server needed)."""

from __future__ import annotations

from duplex_client.cli import DEFAULT_URL, build_parser


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
