"""The talker path: SNAC codec decode batched vs serial, and the talker route's timing.

    python bench/talker.py [--json PATH] [--quick] [--streams 1,8,32]
    python bench/talker.py --codec-only --device cuda [--json PATH]
    python bench/talker.py --remote [--json PATH]   # first audio: local vs `vllm serve` talker

**Codec** (always): N streams each have one steady-state window ready at the same moment
(3 frames of context + 8 new frames + 3 of look-ahead = 14 frames; 8 frames = 683 ms of
audio emitted), as N sessions' windows reach one codec replica together. *batched*: one
decoder call for all N (what the codec stage's batching runtime does); *serial*: one call per
window. Per-chunk latency is from the moment the windows are ready to the moment a window's
audio exists (serial: windows queue behind each other). Real-time streams = seconds of audio
decoded per second of decoder time: how many streams one replica keeps up with.
Both use the published SNAC 24 kHz architecture (random weights: the compute is the same).
This part imports only torch, numpy, snac/einops and two small modules of the project
(engine/snac_model.py, engine/codec_layout.py), so ``--codec-only --device cuda`` runs on a
lent GPU machine that has torch but neither vLLM nor the project's other requirements.

**Talker route** (unless --codec-only; needs the vLLM venv): the ``talker`` and ``codec``
stages of configs/cpu-talker-test.yaml (or ``--config``; there: the tiny Orpheus-layout
talker on vLLM, SNAC on the CPU) in an in-process engine, route ``speech: [talker, codec]``.
*first audio*: one clause in -> its first PCM chunk out, clauses one after another.
*real-time streams*: N clauses at once (N = 1, 2, 4, 8); a stream keeps real time when
each of its chunks arrives before a client that started playing at the first chunk has
played everything before it (no underrun); the figure is the largest N where every stream
does.

JSON keys: ``codec_batch_speedup_at_32`` (serial time / batched time for 32 windows),
``codec_batched_chunk_ms_p50_at_N``/``_p99_at_N``, ``codec_serial_chunk_ms_p50_at_N``/...,
``codec_realtime_streams_batched``/``_serial`` (at the largest N), ``talker_first_audio_ms_p50``,
``talker_realtime_streams``, and details under ``codec``/``talker``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from engine.codec_layout import ORPHEUS  # noqa: E402  (numpy only)
from engine.snac_model import EXACT_MARGIN_FRAMES, build_snac, decode_rows  # noqa: E402

CTX = LOOK = EXACT_MARGIN_FRAMES
NEW = 8
WINDOW = CTX + NEW + LOOK
CLAUSE = "Hello there, this is the talker speaking one clause."


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def codec_bench(
    device: str, streams: list[int], rounds: int, threads: int | None
) -> dict[str, Any]:
    net, torch = build_snac(device, threads=threads)
    rng = np.random.default_rng(0)
    audio_per_window_s = NEW * ORPHEUS.samples_per_frame / ORPHEUS.sample_rate
    out: dict[str, Any] = {"device": device, "window_frames": WINDOW, "new_frames": NEW}
    if device.startswith("cuda"):
        out["gpu"] = torch.cuda.get_device_name(torch.device(device))

    def window() -> list[Any]:
        codes = [int(c) for c in rng.integers(0, 4096, 7 * WINDOW)]
        return ORPHEUS.split(codes)

    def call(rows: list[list[Any]]) -> float:
        t0 = time.perf_counter()
        decode_rows(net, torch, rows, device)  # copies to the host: the device is done
        return time.perf_counter() - t0

    call([window()])  # warm-up (allocator, kernels)
    by_n: dict[str, Any] = {}
    for n in streams:
        rows = [window() for _ in range(n)]
        call(rows)  # warm-up at this batch size
        batched: list[float] = []
        serial: list[float] = []
        t_batched = t_serial = 0.0
        for r in range(rounds):
            for mode in ("batched", "serial") if r % 2 else ("serial", "batched"):
                if mode == "batched":  # alternate the order: neither mode always goes first
                    dt = call(rows)
                    t_batched += dt
                    batched += [dt * 1000.0] * n
                    continue
                elapsed = 0.0
                for row in rows:
                    elapsed += call([row])
                    serial.append(elapsed * 1000.0)
                t_serial += elapsed
        audio_s = rounds * n * audio_per_window_s
        by_n[str(n)] = {
            "batched_s": t_batched / rounds,
            "serial_s": t_serial / rounds,
            "speedup": t_serial / t_batched,
            "batched_chunk_ms_p50": pct(batched, 50),
            "batched_chunk_ms_p99": pct(batched, 99),
            "serial_chunk_ms_p50": pct(serial, 50),
            "serial_chunk_ms_p99": pct(serial, 99),
            "realtime_streams_batched": audio_s / t_batched,
            "realtime_streams_serial": audio_s / t_serial,
        }
        print(
            f"  codec n={n:<3} batched {t_batched / rounds * 1000:8.1f} ms/round  "
            f"serial {t_serial / rounds * 1000:8.1f} ms/round  "
            f"speedup {t_serial / t_batched:5.2f}x  "
            f"rt streams {audio_s / t_batched:6.1f} / {audio_s / t_serial:6.1f}",
            flush=True,
        )
    out["by_n"] = by_n
    return out


async def talker_bench(quick: bool, raw: dict[str, Any]) -> dict[str, Any]:
    import asyncio

    from duplex_contract.batch import AudioOut, SpeechJob
    from engine.api.client import AsyncEngine
    from engine.config import engine_config

    stages = {k: v for k, v in raw["stages"].items() if k in ("talker", "codec")}
    cfg = engine_config({"stages": stages, "routes": {"speech": ["talker", "codec"]}})
    started = time.perf_counter()
    engine = await AsyncEngine.start(cfg)
    start_s = time.perf_counter() - started
    print(f"  talker + codec ready in {start_s:.1f} s", flush=True)
    frame_s = ORPHEUS.samples_per_frame / ORPHEUS.sample_rate

    async def speak(text: str) -> tuple[float, list[tuple[float, float]]]:
        """(first chunk s, [(arrival s, chunk duration s)]) from the submit."""
        t0 = time.perf_counter()
        chunks: list[tuple[float, float]] = []
        async for item in engine.generate(SpeechJob(text=text)):
            if isinstance(item, AudioOut):
                dur = len(item.pcm) / 2 / item.sample_rate
                chunks.append((time.perf_counter() - t0, dur))
        return chunks[0][0], chunks

    try:
        first: list[float] = []
        for _ in range(3 if quick else 6):
            f, _ = await speak(CLAUSE)
            first.append(f * 1000.0)
        print(f"  talker first audio p50 {pct(first, 50):.0f} ms ({len(first)} clauses)")
        by_n: dict[str, Any] = {}
        realtime = 0
        for n in (1, 2, 4) if quick else (1, 2, 4, 8):
            t0 = time.perf_counter()
            runs = await asyncio.gather(*(speak(CLAUSE) for _ in range(n)))
            wall = time.perf_counter() - t0
            ok = 0
            lag: list[float] = []
            audio = 0.0
            for _, chunks in runs:
                t_first = chunks[0][0]
                played = 0.0
                worst = 0.0
                for t, dur in chunks:
                    worst = max(worst, (t - t_first) - played)  # > 0: the client starved
                    played += dur
                audio += played
                lag.append(worst * 1000.0)
                ok += worst <= 0.0
            by_n[str(n)] = {
                "streams_realtime": ok,
                "worst_underrun_ms": max(lag),
                "audio_s_per_wall_s": audio / wall,
                "frames_per_s": audio / frame_s / wall,
            }
            print(
                f"  talker n={n}: {ok}/{n} streams real time, worst underrun {max(lag):.0f} ms, "
                f"{audio / wall:.2f} s audio per s",
                flush=True,
            )
            if ok == n:
                realtime = n
        return {
            "start_s": start_s,
            "first_audio_ms": first,
            "first_audio_ms_p50": pct(first, 50),
            "realtime_streams": realtime,
            "by_n": by_n,
        }
    finally:
        await engine.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--codec-only", action="store_true", help="only the codec (no vLLM needed)")
    ap.add_argument("--device", default="cpu", help="codec device: cpu, cuda, cuda:N")
    ap.add_argument("--streams", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=0, help="codec rounds per N (0: 3, quick 1)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--remote",
        action="store_true",
        help="only first audio, local talker vs the same on `vllm serve` (bench/talker_remote.py)",
    )
    ap.add_argument("--clauses", type=int, default=10, help="--remote: clauses timed per side")
    ap.add_argument(
        "--config",
        type=Path,
        default=ROOT / "configs" / "cpu-talker-test.yaml",
        help="config whose talker and codec stages the talker part runs",
    )
    args = ap.parse_args()
    device = "cuda:0" if args.device == "cuda" else args.device
    streams = [int(s) for s in args.streams.split(",")]
    rounds = args.rounds or (1 if args.quick else 3)
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs; codec on {device}", flush=True)
    result: dict[str, Any] = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs"}
    if args.remote:
        import yaml

        from bench.probe import probe_ms
        from bench.talker_remote import remote_bench

        result["loadavg_1m_before"] = os.getloadavg()[0]
        result["probe_ms"] = probe_ms()
        print(f"load {result['loadavg_1m_before']:.2f}, probe {result['probe_ms']} ms", flush=True)
        raw = yaml.safe_load(args.config.read_text())["engine"]
        result.update(remote_bench(raw, args.clauses, ROOT / "artifacts" / "talker-remote"))
        return _report(result, args.json)
    codec = codec_bench(device, streams, rounds, args.threads)
    result["codec"] = codec
    for n, fig in codec["by_n"].items():
        for key in ("batched", "serial"):
            result[f"codec_{key}_chunk_ms_p50_at_{n}"] = fig[f"{key}_chunk_ms_p50"]
            result[f"codec_{key}_chunk_ms_p99_at_{n}"] = fig[f"{key}_chunk_ms_p99"]
    top = codec["by_n"][str(max(streams))]
    result[f"codec_batch_speedup_at_{max(streams)}"] = top["speedup"]
    result["codec_realtime_streams_batched"] = top["realtime_streams_batched"]
    result["codec_realtime_streams_serial"] = top["realtime_streams_serial"]
    if not args.codec_only:
        import asyncio

        import yaml

        raw = yaml.safe_load(args.config.read_text())["engine"]
        talker = asyncio.run(talker_bench(args.quick, raw))
        result["talker"] = talker
        result["talker_first_audio_ms_p50"] = talker["first_audio_ms_p50"]
        result["talker_realtime_streams"] = talker["realtime_streams"]
    return _report(result, args.json)


def _report(result: dict[str, Any], path: Path | None) -> int:
    print()
    print(f"{'figure':<42} value")
    for key, value in result.items():
        if isinstance(value, float | int) and not isinstance(value, bool):
            print(f"{key:<42} {value:.2f}" if isinstance(value, float) else f"{key:<42} {value}")
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
