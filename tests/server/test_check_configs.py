"""Every shipped config validates here, GPU configs included (``duplex-server check
--no-devices``: the placement is not counted against this machine's GPUs), and the GPU
configs hold what the simulated ladder showed (issue 38): the ``capacity`` policy, codec
windows that do not grow, a talker cap below its real-time limit, memory shares that add up
on one GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from duplex_contract.errors import ConfigError
from duplex_server.__main__ import main
from engine.config import engine_config
from engine.gpu_memory import CONTEXT_GIB
from engine.pipeline.graph import build_graph
from engine.stages.sim_costs import load_costs
from tests.server.harness import ROOT

CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
GPU = [p for p in CONFIGS if p.name.startswith("gpu-")]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_validates_without_a_gpu(
    path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["check", "--config", str(path), "--no-devices"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert f"{path}: ok" in out and "--no-devices: placement not checked" in out
    assert "voice:" in out or "text:" in out


def test_a_gpu_config_without_no_devices_says_which_gpu_is_missing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["check", "--config", str(ROOT / "configs" / "gpu-talker.yaml")]) == 2
    err = capsys.readouterr().err
    assert "engine.stages.asr.devices[0]: 'cuda:0' requested" in err


@pytest.mark.parametrize("path", GPU, ids=lambda p: p.name)
def test_gpu_configs_use_the_capacity_policy(path: Path) -> None:
    engine = yaml.safe_load(path.read_text())["engine"]
    assert engine["scheduling"]["policy"] == "capacity"
    codec = engine["stages"].get("codec")
    if codec is not None:  # windows that do not grow (docs/gpu.md, "Simulated GPU")
        opts = codec["options"]
        assert opts["window_frames"] == opts["first_frames"] == 2


def test_the_talker_cap_is_below_its_real_time_limit() -> None:
    """The cost model's talker (configs/sim/h200-costs.yaml) keeps 82 tokens/s per stream
    up to (1000/82 - step_ms) / step_ms_per_seq streams alone on a GPU."""
    talker = load_costs(ROOT / "configs" / "sim" / "h200-costs.yaml").stages["talker"]
    assert talker.step_ms is not None and talker.step_ms_per_seq
    limit = (1000 / (1000 / 85.333 * 7) - talker.step_ms) / talker.step_ms_per_seq
    cfg = yaml.safe_load((ROOT / "configs" / "gpu-talker.yaml").read_text())["engine"]
    assert cfg["stages"]["talker"]["options"]["max_num_seqs"] < limit


def test_the_memory_shares_on_one_gpu_are_checked() -> None:
    raw = yaml.safe_load((ROOT / "configs" / "gpu-talker.yaml").read_text())["engine"]
    graph = build_graph(engine_config(raw), check_devices=False)
    (use,) = graph.gpu_memory
    assert use.device == "cuda:0" and use.share == pytest.approx(0.70)
    # two EngineCores and this process hold a CUDA context each, beside the estimates
    assert use.gib == pytest.approx(0.6 + 0.2 + 0.0125 * 64 + 3 * CONTEXT_GIB)
    raw["stages"]["llm"]["options"]["gpu_memory_utilization"] = 0.6
    with pytest.raises(ConfigError, match=r"stages on cuda:0: shares 1\.05 .* do not fit"):
        build_graph(engine_config(raw), check_devices=False)
    raw["stages"]["llm"]["devices"] = ["cuda:1"]  # on another GPU they fit
    assert [u.device for u in build_graph(engine_config(raw), check_devices=False).gpu_memory] == [
        "cuda:0",
        "cuda:1",
    ]
