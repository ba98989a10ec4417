"""CPU cost of the sessions' input audio work (decode, resample, VAD), per session-second.

    python bench/input_lanes.py [--sessions N] [--seconds S] [--json PATH]

N sessions stream a real recording (tests/data/beckett.wav, resampled to 24 kHz, the
Realtime API's default rate) in 20 ms frames. Each tick, every session's frame is processed
by the server's own input-lane code (``duplex_server.session.input_lane``) in one of two ways:

* ``per_session``: one job per session, as when sessions' frames arrive one at a time (the
  cost before issue 12's step 4: one Silero call per 32 ms window per session);
* ``batched``: one job for all sessions, as the input scheduler forms under load (Silero
  windows of all sessions scored in one onnxruntime call per round).

Reported: thread CPU time per session-second of audio, for the Silero VAD (the CPU
default) and the energy VAD (the test stage's). An internal figure (no sockets, no event
loop): it isolates the audio work that step 4 batched; bench/realtime.py measures the
whole server. Min of 3 repeats, so a shared machine disturbs it less.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import soundfile as sf

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from audio_kit.pcm import resample_pcm16
from duplex_server.protocol.codec import AudioFormat
from duplex_server.protocol.events import TurnDetection
from duplex_server.session.input_lane import InputLane, InputScheduler, LaneItem, run_jobs

ROOT = Path(__file__).resolve().parents[1]
RATE = 24000
FRAME = 2 * RATE * 20 // 1000  # 20 ms of PCM16


class _NoScheduler(InputScheduler):
    """Lanes are driven by hand here: nothing is scheduled."""

    def __init__(self) -> None:
        pass

    def ready(self, lane: InputLane) -> None:
        pass


def _lanes(n: int, backend: str) -> list[InputLane]:
    lanes = []
    fmt, td = AudioFormat("pcm16", RATE), TurnDetection()
    for _ in range(n):
        lane = InputLane(_NoScheduler(), backend, 1 << 30, lambda p, e: None, print)  # type: ignore[arg-type]
        configured = lane.work([(fmt, td, None)])  # no noise reduction
        if isinstance(configured, BaseException):
            raise configured
        lanes.append(lane)
    return lanes


def run(n: int, seconds: float, backend: str, batched: bool, audio: bytes) -> float:
    """CPU ms per session-second."""
    lanes = _lanes(n, backend)
    frames = int(seconds * 50)
    offsets = [(i * 7919 * FRAME) % (len(audio) - FRAME) for i in range(n)]  # out of phase
    t0 = time.thread_time()
    for f in range(frames):
        jobs: list[tuple[InputLane, list[LaneItem]]] = []
        for lane, off in zip(lanes, offsets, strict=True):
            start = (off + f * FRAME) % (len(audio) - FRAME)
            start -= start % 2
            jobs.append((lane, [audio[start : start + FRAME]]))
        results = run_jobs(jobs) if batched else [r for job in jobs for r in run_jobs([job])]
        if failed := [r for r in results if isinstance(r, BaseException)]:
            raise failed[0]
    return 1000 * (time.thread_time() - t0) / (n * seconds)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=4.0, help="audio per session")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    pcm, rate = sf.read(ROOT / "tests" / "data" / "beckett.wav", dtype="int16")
    audio = resample_pcm16(pcm.tobytes(), rate, RATE)
    result: dict[str, Any] = {"sessions": args.sessions, "frame_ms": 20, "input_rate": RATE}
    print(f"{args.sessions} sessions, 20 ms frames at {RATE} Hz, CPU ms per session-second:")
    print(f"  {'vad':8s} {'per_session':>12s} {'batched':>10s}")
    for backend in ("silero", "energy"):
        row = {}
        for mode in ("per_session", "batched"):
            row[mode] = min(
                run(args.sessions, args.seconds, backend, mode == "batched", audio)
                for _ in range(3)
            )
        result[f"input_cpu_ms_per_session_s_{backend}"] = row
        print(f"  {backend:8s} {row['per_session']:12.2f} {row['batched']:10.2f}")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
