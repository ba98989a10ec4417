"""GPU placement of vLLM replicas (engine/placement.py, engine/stages/vllm_env.py): which GPUs
a replica takes, what its EngineCore process sees, and the errors for placements that
cannot work. No GPU and no vLLM needed: the spawn is a real ``multiprocessing`` child or a
fake."""

from __future__ import annotations

import functools
import multiprocessing
import os
import threading
import time
from typing import Any

import pytest

from duplex_contract.errors import ConfigError
from engine.config import StageConfig
from engine.placement import child_visible_devices, replica_gpus, visible_entries
from engine.stages import vllm_env
from engine.stages.backends import build_replicas
from engine.stages.llm_vllm import VllmLlm, VllmOptions
from engine.startup import start_devices
from tests.engine.conftest import UNIT

CVD = "CUDA_VISIBLE_DEVICES"


def gpus(device: str, ids: tuple[int, ...] | None = None, tp: int = 1, count: int = 4) -> Any:
    return replica_gpus(
        device=device,
        device_ids=ids,
        tensor_parallel_size=tp,
        cuda_count=count,
        where="engine.stages.llm",
        replica="llm0",
    )


def test_replica_gpus() -> None:
    assert gpus("cuda:2") == (2,)
    assert gpus("auto") is None and gpus("cpu") is None
    assert gpus("auto", (1, 3), tp=2) == (1, 3)
    assert gpus("cuda:3", (1, 3), tp=2) == (1, 3)
    assert gpus("auto", (7,), count=0) == (7,)  # no CUDA here: the range is not checked


@pytest.mark.parametrize(
    ("device", "ids", "tp", "message"),
    [
        ("auto", (0, 0), 2, r"device_ids: GPU 0 is listed twice in \[0, 0\]"),
        ("auto", (-1,), 1, r"device_ids: -1 is not a GPU index"),
        ("auto", (), 1, r"device_ids: empty"),
        ("auto", (0, 1), 1, r"device_ids: 2 GPU\(s\) \[0, 1\] for tensor_parallel_size=1"),
        ("auto", (4,), 1, r"device_ids: GPU 4 does not exist: CUDA reports 4 GPU\(s\)"),
        ("cuda:2", (0, 1), 2, r"devices: replica llm0 is placed on 'cuda:2', which .*\[0, 1\]"),
        ("cpu", (0,), 1, r"device_ids: replica llm0 is placed on 'cpu', which has no GPUs"),
        ("cuda:1", None, 2, r"device_ids: replica llm0 is placed on 'cuda:1' with tensor_par"),
    ],
)
def test_placement_errors_name_the_field(
    device: str, ids: tuple[int, ...] | None, tp: int, message: str
) -> None:
    with pytest.raises(ConfigError, match=r"^engine\.stages\.llm\.(options\.)?" + message):
        gpus(device, ids, tp)


def test_child_sees_only_its_gpus_through_a_preset_variable() -> None:
    assert visible_entries(None) is None
    assert visible_entries("2, 3,-1,4") == ["2", "3"]
    assert child_visible_devices((1,), None, where="w", replica="r") == "1"
    assert child_visible_devices((0, 1), None, where="w", replica="r") == "0,1"
    # cuda:N counts within the preset list, as torch in this process does
    assert child_visible_devices((1,), "5,7", where="w", replica="r") == "7"
    assert child_visible_devices((0,), "GPU-aa,GPU-bb", where="w", replica="r") == "GPU-aa"


@pytest.mark.parametrize(
    ("preset", "shows"), [("0", r"1 GPU\(s\) \(0\)"), ("", "no GPU"), ("-1", "no GPU")]
)
def test_a_preset_variable_that_hides_the_pinned_gpu_is_an_error(preset: str, shows: str) -> None:
    with pytest.raises(
        ConfigError,
        match=rf"^engine\.stages\.llm\.devices: replica llm1 is pinned to cuda:1, but this "
        rf"process's environment sets CUDA_VISIBLE_DEVICES='{preset}', which shows {shows}",
    ):
        child_visible_devices((1,), preset, where="engine.stages.llm.devices", replica="llm1")


def test_vllm_replicas_are_checked_when_built(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(VllmLlm, "cuda_device_count", classmethod(lambda cls: 2))
    monkeypatch.delenv(CVD, raising=False)
    built = build_replicas(
        "llm", StageConfig(backend="vllm", replicas=2, devices=("cuda:0", "cuda:1"))
    )
    assert [r.placement.gpus for r in built] == [(0,), (1,)]  # type: ignore[attr-defined]
    assert [start_devices(r) for r in built] == [{"cuda:0"}, {"cuda:1"}]
    auto = build_replicas("llm", StageConfig(backend="vllm"))[0]
    assert start_devices(auto) == {"cuda:0", "cuda:1"}  # vLLM places itself: every GPU
    with pytest.raises(ConfigError, match=r"engine\.stages\.llm\.options\.device_ids: GPU 2 "):
        build_replicas("llm", StageConfig(backend="vllm", options={"device_ids": [2]}))
    monkeypatch.setenv(CVD, "1")
    with pytest.raises(
        ConfigError, match=r"engine\.stages\.llm\.devices: replica llm1 is pinned to cuda:1"
    ):
        build_replicas("llm", StageConfig(backend="vllm", replicas=2, devices=("cuda:0", "cuda:1")))


def test_pinned_env_is_the_childs_own_and_put_back() -> None:
    os.environ.pop(CVD, None)
    os.environ["OMP_NUM_THREADS"] = "7"
    try:
        with vllm_env.engine_env(
            {"OMP_NUM_THREADS": "2", "DX_TEST_DEFAULT": "x"}, {CVD: "1"}, spawned=lambda: False
        ):
            assert os.environ[CVD] == "1"
            assert os.environ["OMP_NUM_THREADS"] == "7"  # a default never overrides
            assert os.environ["DX_TEST_DEFAULT"] == "x"
        assert CVD not in os.environ and "DX_TEST_DEFAULT" not in os.environ
        assert os.environ["OMP_NUM_THREADS"] == "7"
        assert not vllm_env.START_LOCK.locked()
    finally:
        os.environ.pop("OMP_NUM_THREADS", None)


def test_two_replicas_starting_together_each_spawn_with_their_own_gpu() -> None:
    """Fake spawns: each engine reads the variable when it 'spawns', then takes a while to
    become ready. The second may spawn while the first is still loading (the lock is held
    only until the spawn), and neither sees the other's GPU."""
    seen: dict[str, str | None] = {}
    spawned = {"a": threading.Event(), "b": threading.Event()}
    a_loading = threading.Event()
    b_spawned_while_a_loads = threading.Event()

    def engine(name: str, gpu: str) -> None:
        with vllm_env.engine_env({}, {CVD: gpu}, spawned=spawned[name].is_set, poll_s=0.005):
            time.sleep(0.02)  # argument checks before the spawn
            seen[name] = os.environ.get(CVD)
            spawned[name].set()
            if name == "a":
                a_loading.set()
                # loading: b must get through its spawn meanwhile
                if not spawned["b"].wait(5 * UNIT):
                    return
                b_spawned_while_a_loads.set()
            else:
                time.sleep(0.05)

    os.environ.pop(CVD, None)
    ta = threading.Thread(target=engine, args=("a", "0"))
    ta.start()
    assert a_loading.wait(5 * UNIT)
    tb = threading.Thread(target=engine, args=("b", "1"))
    tb.start()
    ta.join(10 * UNIT)
    tb.join(10 * UNIT)
    assert seen == {"a": "0", "b": "1"}
    assert b_spawned_while_a_loads.is_set()
    assert CVD not in os.environ and not vllm_env.START_LOCK.locked()


def _report_env(conn: Any) -> None:
    conn.send(os.environ.get(CVD))
    conn.close()


def test_a_real_child_process_inherits_the_pinned_gpu() -> None:
    """The default spawn check: a new ``EngineCore*`` child of this process."""
    ctx = multiprocessing.get_context("spawn")
    results: dict[str, str | None] = {}

    def engine(gpu: str) -> None:
        parent, child = ctx.Pipe()
        with vllm_env.engine_env({}, {CVD: gpu}):
            proc = ctx.Process(target=_report_env, args=(child,), name=f"EngineCore_{gpu}")
            proc.start()
            # the lock is let go once the child exists, before the block ends
            deadline = time.monotonic() + 10 * UNIT
            while vllm_env.START_LOCK.locked() and time.monotonic() < deadline:
                time.sleep(0.01)
            results[f"released{gpu}"] = "yes" if not vllm_env.START_LOCK.locked() else "no"
            results[gpu] = parent.recv() if parent.poll(30 * UNIT) else "timeout"
        proc.join(10 * UNIT)

    os.environ.pop(CVD, None)
    engine("0")
    engine("1")
    assert results == {"released0": "yes", "0": "0", "released1": "yes", "1": "1"}
    assert CVD not in os.environ


def test_options_validate_restart_knobs() -> None:
    from engine.config import convert

    with pytest.raises(ConfigError, match=r"llm\.options\.max_restarts: Expected `int` >= 0"):
        convert({"max_restarts": -1}, VllmOptions, where="llm.options")
    opts = VllmOptions()
    assert (opts.max_restarts, opts.restart_backoff_s, opts.log_stats) == (3, 1.0, True)


def test_a_replica_reads_its_placement_under_the_start_lock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Replica b's CUDA_VISIBLE_DEVICES is derived from this process's own value, which
    replica a's spawn replaces while it holds the start lock. Read before the lock (as the
    stage once did), b pinned to cuda:1 saw a's "7" and was refused (or, pinned to cuda:0,
    took a's GPU); read under it, b gets the parent's entry for cuda:1."""
    monkeypatch.setenv(CVD, "5,7")
    opts = VllmOptions()
    a = vllm_env.VllmPlacement(opts, name="llm0", stage="llm", device="cuda:0", cuda_count=2)
    b = vllm_env.VllmPlacement(opts, name="llm1", stage="llm", device="cuda:1", cuda_count=2)
    a_spawned, a_holds, checked = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, str | None] = {}

    def start_a() -> None:
        with vllm_env.engine_env({}, functools.partial(a.env, "cuda"), spawned=a_spawned.is_set):
            seen["a"] = os.environ.get(CVD)
            a_holds.set()
            checked.wait(5 * UNIT)
            time.sleep(0.05)  # b asks for its placement now: it waits for the lock
            a_spawned.set()
            time.sleep(0.05)

    ta = threading.Thread(target=start_a)
    ta.start()
    assert a_holds.wait(5 * UNIT)
    assert os.environ[CVD] == "5"  # a's child's value, while a holds the lock
    with pytest.raises(ConfigError, match="replica llm1 is pinned to cuda:1"):
        b.env("cuda")  # what a read outside the lock got
    checked.set()
    with vllm_env.engine_env({}, functools.partial(b.env, "cuda"), spawned=lambda: False):
        seen["b"] = os.environ.get(CVD)
    ta.join(5 * UNIT)
    assert seen == {"a": "5", "b": "7"}
    assert os.environ[CVD] == "5,7" and not vllm_env.START_LOCK.locked()
