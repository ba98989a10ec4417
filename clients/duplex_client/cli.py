"""``duplex-client``: talk to a WAV, batch speech, or a text chat in the terminal.

duplex-client talk --wav in.wav --out reply.wav     # per turn: transcript, answer, TTFA
duplex-client say "Hello there" --out hello.wav     # POST /v1/audio/speech
duplex-client chat "What is a duplex session?"      # text session (no text: interactive)
duplex-client offer --out offer.sdp                 # an SDP offer for POST /v1/realtime/calls
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import urllib.parse
from pathlib import Path

import httpx
import soundfile
from websockets.exceptions import WebSocketException

from duplex_client import events as ev
from duplex_client.client import DuplexClient
from duplex_client.errors import SessionRefused
from duplex_client.offer import make_offer
from duplex_client.talk import talk

DEFAULT_URL = os.environ.get("DUPLEX_URL", "ws://127.0.0.1:8000/v1/realtime")


ENDPOINTS = ("/v1/realtime", "/v1/duplex")


def url_problem(url: str) -> str | None:
    """What is wrong with a ``--url`` and the one that would work (None: nothing)."""
    parts = urllib.parse.urlsplit(url)
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    if scheme not in ("ws", "wss") or not parts.netloc:
        return (
            f"--url {url!r} is not a WebSocket URL; the server's is like "
            "--url ws://127.0.0.1:8000/v1/realtime"
        )
    path = parts.path.rstrip("/")
    fixed = urllib.parse.urlunsplit(
        (scheme, parts.netloc, path if path in ENDPOINTS else ENDPOINTS[0], parts.query, "")
    )
    if parts.scheme != scheme:
        return f"--url {url!r} is an HTTP URL; the realtime socket is a WebSocket: --url {fixed}"
    if path not in ENDPOINTS:
        return f"--url {url!r} names no realtime endpoint (/v1/realtime): --url {fixed}"
    return None


def _http_base(ws_url: str) -> str:
    base = ws_url.replace("ws://", "http://", 1).replace("wss://", "https://", 1)
    return base.split("/v1/", 1)[0]


async def chat(url: str, api_key: str | None, text: str | None) -> int:
    async with await DuplexClient.connect(url, api_key=api_key) as client:
        await client.update_session(
            {"output_modalities": ["text"], "audio": {"input": {"turn_detection": None}}}
        )
        lines = [text] if text else None
        while True:
            if lines is not None:
                if not lines:
                    return 0
                line = lines.pop()
            else:
                try:
                    line = await asyncio.to_thread(input, "you> ")
                except EOFError:
                    return 0
            if not line.strip():
                continue
            await client.send_text(line)
            print("assistant> ", end="", flush=True)
            async for event in client.events():
                if isinstance(event, ev.TextDelta | ev.TranscriptDelta):
                    print(event.delta, end="", flush=True)
                elif isinstance(event, ev.Error):
                    print(f"\nerror: {event.error.code}: {event.error.message}", file=sys.stderr)
                elif isinstance(event, ev.ResponseDone):
                    print()
                    break


def say(base: str, api_key: str | None, text: str, out: Path, fmt: str, voice: str) -> int:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    body = {"model": "duplex", "input": text, "voice": voice, "response_format": fmt}
    started = time.monotonic()
    first: float | None = None
    with (
        httpx.stream(
            "POST", f"{base}/v1/audio/speech", json=body, headers=headers, timeout=120.0
        ) as resp,
        out.open("wb") as f,
    ):
        if resp.status_code != 200:
            resp.read()
            print(f"duplex-client: HTTP {resp.status_code}: {_error_text(resp)}", file=sys.stderr)
            return 1
        for chunk in resp.iter_bytes():
            if first is None:
                first = time.monotonic()
            f.write(chunk)
    if fmt == "wav":  # a streamed WAV says "length unknown"; rewrite it with exact sizes
        samples, rate = soundfile.read(out, dtype="int16")
        soundfile.write(out, samples, rate, subtype="PCM_16")
    took = time.monotonic() - started
    ttfb = (first - started) * 1000 if first is not None else float("nan")
    print(f"wrote {out} ({out.stat().st_size} bytes); first byte {ttfb:.0f} ms, total {took:.2f} s")
    return 0


def _error_text(resp: httpx.Response) -> str:
    """An OpenAI-shaped error body's message, else the body."""
    try:
        err = resp.json()["error"]
        return f"{err['message']} ({err['code']})"
    except (ValueError, KeyError, TypeError):
        return resp.text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="duplex-client", description=__doc__.split("\n")[0])
    parser.add_argument("--url", default=DEFAULT_URL, help="WebSocket URL (env DUPLEX_URL)")
    parser.add_argument("--api-key", default=os.environ.get("DUPLEX_API_KEY"))
    # the same options after the subcommand (``talk --url X``); given there, they win
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", default=argparse.SUPPRESS, help="WebSocket URL")
    common.add_argument("--api-key", default=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True)
    p_talk = sub.add_parser(
        "talk",
        parents=[common],
        help="speak a WAV as a microphone; per turn: transcript, answer, TTFA",
    )
    p_talk.add_argument("--wav", type=Path, required=True, help="mono 16-bit WAV")
    p_talk.add_argument("--out", type=Path, help="write the reply here (24 kHz WAV)")
    p_talk.add_argument("--fast", action="store_true", help="send faster than real time")
    p_talk.add_argument(
        "--talk-over",
        action="store_true",
        help="stream the WAV straight through, interrupting answers (default: wait for each)",
    )
    p_talk.add_argument(
        "--interrupt-mode",
        choices=["immediate", "confirm"],
        help="how speech over an answer is judged (docs/protocol.md §6.1; default: the server's)",
    )
    p_say = sub.add_parser("say", parents=[common], help="batch speech (POST /v1/audio/speech)")
    p_say.add_argument("text")
    p_say.add_argument("--out", type=Path, required=True)
    p_say.add_argument("--format", default="wav", choices=["wav", "pcm", "flac", "mp3", "opus"])
    p_say.add_argument("--voice", default="alloy")
    p_chat = sub.add_parser("chat", parents=[common], help="text session in the terminal")
    p_chat.add_argument("text", nargs="?", help="one message (default: interactive)")
    p_offer = sub.add_parser(
        "offer", help="write an SDP offer (audio + the oai-events channel) for the calls API"
    )
    p_offer.add_argument("--out", type=Path, help="write it here (default: standard output)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    problem = url_problem(args.url) if args.command != "offer" else None
    if problem is not None:
        print(f"duplex-client: {problem}", file=sys.stderr)
        return 2
    try:
        if args.command == "talk":
            return asyncio.run(
                talk(
                    args.url,
                    args.api_key,
                    args.wav,
                    args.out,
                    args.fast,
                    talk_over=args.talk_over,
                    interrupt_mode=args.interrupt_mode,
                )
            )
        if args.command == "offer":
            sdp = asyncio.run(make_offer())
            if args.out is None:
                sys.stdout.write(sdp)
            else:
                args.out.write_text(sdp)
                n = sum(line.startswith("a=candidate:") for line in sdp.splitlines())
                print(
                    f"wrote {args.out}: an SDP offer ({len(sdp)} bytes: Opus audio, the "
                    f"oai-events data channel, {n} ICE candidate(s)); POST it to "
                    "/v1/realtime/calls (its peer is gone: the answer shows the exchange only)"
                )
            return 0
        if args.command == "say":
            base = _http_base(args.url)
            return say(base, args.api_key, args.text, args.out, args.format, args.voice)
        return asyncio.run(chat(args.url, args.api_key, args.text))
    except SessionRefused as exc:
        hint = " (pass --api-key KEY or set DUPLEX_API_KEY)" if exc.code == "unauthorized" else ""
        print(f"duplex-client: {exc}{hint}", file=sys.stderr)
        return 1
    except ConnectionRefusedError:
        where = urllib.parse.urlsplit(args.url).netloc
        print(
            f"duplex-client: nothing listens at {where} (start the server: make serve)",
            file=sys.stderr,
        )
        return 1
    except (OSError, ConnectionError, WebSocketException) as exc:
        print(f"duplex-client: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
