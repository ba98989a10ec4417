"""How late the server's VAD decides, by input format: the input lane's own code, offline.

    python bench/vad_delay.py [--vad silero|energy] [--json PATH]

Every recording in tests/data is rendered in each input format a client may send
(``audio.input.format``: PCM16 at 16, 24 and 48 kHz (48 kHz: what a WebRTC call's Opus
decodes to, which its input path brings to 16 kHz the same way), G.711 u-law at 8 kHz; soxr
HQ from the file, as a client's own resampler would) and streamed in 20 ms frames through
the session's input processor (``duplex_server.session.input_processor``: decode,
resampling to 16 kHz, VAD, segmenter, server_vad defaults). For each speech start and stop
the bench notes when it was decided, as the time the last frame needed had arrived, and
compares it with the same decision for the 16 kHz stream, which needs no resampling. The
difference is what the format's conversion adds to a barge-in and to a turn's end (a
streaming resampler's delay, and its output coming in blocks: soxr's added ~18 ms on
average at 24 kHz, up to 40; the input path's own resamplers,
audio_kit.pcm.input_resampler, add none).

An internal figure with no sockets: the audio's own clock, so it hardly depends on the
machine. Prints a table; JSON: per format under ``formats``: ``events``,
``vad_delay_ms_mean``, ``vad_delay_ms_p50``, ``vad_delay_ms_max`` (decisions that differ in
number from the 16 kHz stream's are reported as ``mismatched`` and left out).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np
import soundfile as sf
import soxr

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from audio_kit.g711 import pcm16_to_g711
from duplex_server.protocol.codec import AudioFormat
from duplex_server.protocol.events import TurnDetection
from duplex_server.protocol.vad_events import VadStart, VadStop
from duplex_server.session.input_processor import InputProcessor

ROOT = Path(__file__).resolve().parents[1]
FRAME_MS = 20
#: (name, codec, rate)
FORMATS = [
    ("pcm16 16 kHz", "pcm16", 16000),
    ("pcm16 24 kHz", "pcm16", 24000),
    ("pcm16 48 kHz", "pcm16", 48000),
    ("g711_ulaw 8 kHz", "g711_ulaw", 8000),
]


def render(audio: np.ndarray, rate: int, codec: str, out_rate: int) -> bytes:
    """The recording as a client sends it in this format."""
    x = soxr.resample(audio.astype(np.float32), rate, out_rate, quality="HQ")
    pcm = np.clip(np.rint(x * 32768.0), -32768, 32767).astype("<i2").tobytes()
    return pcm if codec == "pcm16" else pcm16_to_g711(pcm, codec)


def decisions(data: bytes, codec: str, rate: int, vad: str) -> list[tuple[str, float]]:
    """(kind, arrival ms) of each speech start and stop, streaming 20 ms frames."""
    proc = InputProcessor(AudioFormat(codec, rate), TurnDetection(), vad)  # type: ignore[arg-type]
    width = 2 if codec == "pcm16" else 1
    frame = rate * FRAME_MS // 1000 * width
    out: list[tuple[str, float]] = []
    for i in range(0, len(data) - frame + 1, frame):
        arrived_ms = (i + frame) / width / rate * 1000.0
        _, events = proc.process(data[i : i + frame], 0.0)
        out += [(type(e).__name__, arrived_ms) for e in events if isinstance(e, VadStart | VadStop)]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vad", choices=["silero", "energy"], default="silero")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    clips = sorted((ROOT / "tests" / "data").glob("*.wav"))
    delays: dict[str, list[float]] = {name: [] for name, _, _ in FORMATS}
    mismatched: dict[str, int] = {name: 0 for name, _, _ in FORMATS}
    for path in clips:
        audio, rate = sf.read(path, dtype="float32")
        runs = {
            name: decisions(render(audio, rate, codec, r), codec, r, args.vad)
            for name, codec, r in FORMATS
        }
        base = runs[FORMATS[0][0]]
        for name, got in runs.items():
            if [k for k, _ in got] != [k for k, _ in base]:
                mismatched[name] += 1
                continue
            delays[name] += [t - t0 for (_, t), (_, t0) in zip(got, base, strict=True)]
    result: dict[str, Any] = {"vad": args.vad, "clips": [p.name for p in clips], "formats": {}}
    print(f"VAD {args.vad}, {len(clips)} recordings; decision delay vs 16 kHz PCM (ms)")
    print(f"{'format':18} {'events':>6} {'mean':>6} {'p50':>6} {'max':>6}  mismatched clips")
    for name, _, _ in FORMATS:
        d = delays[name]
        row = {
            "events": len(d),
            "vad_delay_ms_mean": round(statistics.fmean(d), 1) if d else None,
            "vad_delay_ms_p50": round(statistics.median(d), 1) if d else None,
            "vad_delay_ms_max": round(max(d), 1) if d else None,
            "mismatched": mismatched[name],
        }
        result["formats"][name] = row
        print(
            f"{name:18} {row['events']:>6} {row['vad_delay_ms_mean']!s:>6} "
            f"{row['vad_delay_ms_p50']!s:>6} {row['vad_delay_ms_max']!s:>6}  {mismatched[name]}"
        )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
