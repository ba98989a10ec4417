"""How long a real browser holds the server's WebRTC audio before it plays it.

Opens the browser client (clients/web) in headless Chromium (Debian ``chromium`` +
``chromium-driver``, as tests/web/test_browser.py does) against the real server on
127.0.0.1 (the tests' configuration: the test ASR, LLM and a real-time TTS, so the figure is
the transport's, not the models'), switches it to WebRTC, lets its fake microphone ask a
question, and reads Chromium's own statistics of the incoming audio while the answer
plays (``getStats()`` on the ``inbound-rtp`` audio: ``jitterBufferDelay`` and
``jitterBufferTargetDelay`` over ``jitterBufferEmittedCount``, the page's
``window.duplexState.rtcJitterBufferMs`` / ``rtcJitterTargetMs``): the mean time a sample
waited in NetEq, Chromium's jitter buffer, and the delay it aimed for.

Why: bench/turn_taking.py's WebRTC far end is aiortc, whose audio jitter buffer holds 4
packets (80 ms) before it plays; a stop is heard when the listener's buffer has drained, so
that bench's far end holds what a browser holds (tests/server/webrtc_client.py
``BROWSER_PREFETCH``), and this is the measure it is set from.

    python bench/browser_jitter.py [--seconds 20] [--json PATH]

Prints the mean held and target ms (cumulative over the call, read once a second) and writes
JSON: ``jitter_buffer_ms``, ``jitter_target_ms``, ``packets``, ``chromium``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.server.harness import REALTIME_TTS, running_server, write_config  # noqa: E402
from tests.web import test_browser as page  # noqa: E402


def measure(seconds: float) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="browser-jitter-"))
    wav = tmp / "mic.wav"
    page._mic_wav(wav)
    config = write_config(tmp, engine=REALTIME_TTS)
    state: dict[str, Any] = {}
    with running_server(Path(config)) as addr:
        for driver in page._chromium(wav):
            page._open(driver, f"http://{addr}/")
            driver.find_element("id", "webrtc").click()
            driver.find_element("id", "connect").click()
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                time.sleep(1.0)
                state = page._state(driver)
    if not state.get("rtcJitterBufferMs"):
        raise SystemExit(f"Chromium reported no incoming audio: {state}")
    version = subprocess.run(
        [page.CHROMIUM, "--version"], capture_output=True, text=True, check=False
    ).stdout.strip()
    return {
        "jitter_buffer_ms": round(state["rtcJitterBufferMs"], 1),
        "jitter_target_ms": round(state["rtcJitterTargetMs"], 1),
        "packets": state["rtcPacketsReceived"],
        "chromium": version,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0, help="how long the call lasts")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args()
    row = measure(args.seconds)
    print(f"{'jitter_buffer_ms':>18} {'jitter_target_ms':>18} {'packets':>8}  browser")
    print(
        f"{row['jitter_buffer_ms']:>18} {row['jitter_target_ms']:>18} {row['packets']:>8}  "
        f"{row['chromium']}"
    )
    if args.json:
        args.json.write_text(json.dumps(row, indent=2) + "\n")


if __name__ == "__main__":
    main()
