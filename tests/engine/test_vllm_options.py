"""vLLM's parallelism options of the local vLLM stages: accepted, passed through to
``AsyncEngineArgs``, and refused with a clear error where they can't run (no vLLM import)."""

from __future__ import annotations

import msgspec
import pytest

from duplex_contract.errors import ConfigError
from engine.config import convert
from engine.stages import vllm_options
from engine.stages.llm_vllm import VllmLlm
from engine.stages.talker_vllm import TalkerOptions
from engine.stages.vllm_options import (
    VllmOptions,
    check_engine_args,
    check_parallel,
    engine_kwargs,
    workers,
)

FIELD = "engine.stages.llm.options"


def check(opts: VllmOptions, device: str = "auto", cuda: int = 8, ray: bool = True) -> None:
    check_parallel(opts, field=FIELD, device=device, cuda_count=cuda, has_ray=ray)


def test_the_options_convert_and_reach_the_engine_arguments() -> None:
    raw = {
        "tensor_parallel_size": 2,
        "pipeline_parallel_size": 2,
        "data_parallel_size": 2,
        "distributed_executor_backend": "mp",
    }
    opts = convert(raw, VllmOptions, where=FIELD)
    assert workers(opts) == 8
    check(opts, cuda=8)
    kwargs = engine_kwargs(opts, "/m", {"logits_processors": ["x:Y"]})
    assert kwargs["tensor_parallel_size"] == 2
    assert kwargs["pipeline_parallel_size"] == 2 and kwargs["data_parallel_size"] == 2
    assert kwargs["distributed_executor_backend"] == "mp"
    assert kwargs["logits_processors"] == ["x:Y"] and kwargs["model"] == "/m"
    # the talker's options are the same (its stage is a vLLM stage too)
    talker = convert({"data_parallel_size": 4, "layout": "orpheus"}, TalkerOptions, where=FIELD)
    assert engine_kwargs(talker, "/t", {})["data_parallel_size"] == 4


def test_defaults_pass_nothing_an_older_vllm_lacks() -> None:
    kwargs = engine_kwargs(VllmOptions(), "/m", {})
    for key in ("pipeline_parallel_size", "data_parallel_size", "distributed_executor_backend"):
        assert key not in kwargs
    check(VllmOptions(), device="cpu", cuda=0, ray=False)


def test_an_unknown_executor_or_a_zero_size_is_refused_by_the_schema() -> None:
    with pytest.raises(ConfigError, match="distributed_executor_backend"):
        convert({"distributed_executor_backend": "slurm"}, VllmOptions, where=FIELD)
    with pytest.raises(ConfigError, match="data_parallel_size"):
        convert({"data_parallel_size": 0}, VllmOptions, where=FIELD)


@pytest.mark.parametrize(
    ("options", "kw", "message"),
    [
        ({"distributed_executor_backend": "external_launcher"}, {}, "torchrun"),
        ({"distributed_executor_backend": "uni", "tensor_parallel_size": 2}, {}, "one worker"),
        ({"distributed_executor_backend": "ray"}, {"ray": False}, "ray package"),
        ({"data_parallel_size": 2}, {"device": "cpu"}, "placed on 'cpu'"),
        ({"tensor_parallel_size": 2, "data_parallel_size": 2}, {"cuda": 2}, "needs 4 GPUs"),
        ({"pipeline_parallel_size": 2, "device_ids": (0, 1, 2)}, {}, "list exactly 2"),
    ],
)
def test_what_cannot_run_is_refused_naming_the_option(
    options: dict[str, object], kw: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        check(VllmOptions(**options), **kw)  # type: ignore[arg-type]
    assert str(err.value).startswith(FIELD)


def test_ray_places_its_workers_on_its_cluster() -> None:
    # more workers than this node's GPUs: fine on Ray (the cluster has them), not on mp
    opts = VllmOptions(tensor_parallel_size=8, pipeline_parallel_size=2)
    check(msgspec.structs.replace(opts, distributed_executor_backend="ray"), cuda=8)
    with pytest.raises(ConfigError, match="needs 16 GPUs"):
        check(opts, cuda=8)


def test_an_option_the_installed_vllm_lacks_is_refused_with_its_version() -> None:
    kwargs = engine_kwargs(VllmOptions(data_parallel_size=2), "/m", {})
    with pytest.raises(ConfigError, match=r"data_parallel_size: the installed vLLM 0\.1\.0 has"):
        check_engine_args(kwargs, set(kwargs) - {"data_parallel_size"}, "0.1.0", FIELD)
    check_engine_args(kwargs, set(kwargs), "0.1.0", FIELD)


def test_the_stage_refuses_at_construction(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"engine\.stages\.llm\.options: .*placed on 'cpu'"):
        VllmLlm(VllmOptions(data_parallel_size=2), "llm", device="cpu")
    monkeypatch.setattr(vllm_options, "ray_installed", lambda: False)
    with pytest.raises(ConfigError, match="distributed_executor_backend: 'ray' needs the ray"):
        VllmLlm(VllmOptions(distributed_executor_backend="ray"), "llm", device="cpu")
