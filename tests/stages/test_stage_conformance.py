"""Every backend of the backend table (engine/stages/backends.py) against the stage interface
(engine/stages/base.py).

Each ``BACKENDS`` entry is built the way a config builds it (``build_replicas``: options
checked, device resolved, nothing loaded), once per role it plays, and checked: the class
has what the table reads, the replica every member the engine uses with the right kind,
its edges are edge types the graph accepts, and each optional capability it declares is
consistent (a backend on the batching runtime exposes its ``max_batch`` as its capacity, ...).
A backend added to the table is checked here without editing this file; one that lacks a
member fails.
"""

from __future__ import annotations

import asyncio
import inspect
from pathlib import Path
from typing import Any

import msgspec
import pytest

from duplex_contract.errors import ConfigError
from engine.config import StageConfig, engine_config
from engine.pipeline.graph import build_graph, stage_info
from engine.stage_figures import (
    DecodeSource,
    EngineFiguresSource,
    QueueWaitSource,
    StageEngineFigures,
    StepSource,
)
from engine.stages import backends, sim, testing
from engine.stages.base import (
    BatchSizeSource,
    CapacitySource,
    ChunkerSource,
    HealthSource,
    StageBackend,
    StageBackendClass,
    missing_members,
    protocol_members,
)
from engine.stages.batching import BatchingRuntime
from engine.stages.edges import Edge
from engine.startup import PlacedBackend
from engine.voices import Voiced

DOCS = Path(__file__).resolve().parents[2] / "docs" / "engine.md"

#: backends that play several roles: the stage names they are built under (one per role)
ROLES: dict[str, tuple[str, ...]] = {
    "test": tuple(testing.ROLES),
    "test-batch": ("asr", "llm", "tts"),
    "sim": tuple(sim.ROLES),
    "openai": ("llm", "asr", "tts"),
}
#: options a backend cannot run without (everything else: its defaults)
REQUIRED_OPTIONS: dict[str, dict[str, Any]] = {
    "openai": {"base_url": "http://127.0.0.1:9/v1"},
    "openai-talker": {"base_url": "http://127.0.0.1:9/v1"},
}


def _cases() -> list[tuple[str, str]]:
    return [(b, stage) for b in sorted(backends.BACKENDS) for stage in ROLES.get(b, ("stage",))]


def _class(backend: str) -> StageBackendClass:
    try:
        return backends.backend_class(backend)
    except ConfigError as exc:
        if "is not installed" in str(exc):  # its library is absent here (a GPU venv's)
            pytest.skip(f"{backend}: {exc}")
        raise


def _build(backend: str, stage: str) -> StageBackend:
    _class(backend)
    config = StageConfig(backend=backend, options=REQUIRED_OPTIONS.get(backend, {}))
    (replica,) = backends.build_replicas(stage, config)
    return replica


@pytest.mark.parametrize("backend", sorted(backends.BACKENDS))
def test_backend_class_has_what_the_table_reads(backend: str) -> None:
    cls = _class(backend)
    assert missing_members(cls, StageBackendClass) == []
    assert isinstance(cls, StageBackendClass)
    assert inspect.isclass(cls.Options) and issubclass(cls.Options, msgspec.Struct)
    kinds = cls.device_kinds
    assert isinstance(kinds, frozenset) and kinds and kinds <= {"cpu", "cuda"}, kinds
    assert isinstance(cls.keeps_auto, bool)
    if cls.keeps_auto:  # it places itself: only meaningful where a GPU may be
        assert "cuda" in kinds
    count = cls.cuda_device_count()
    assert isinstance(count, int) and count >= 0
    if "cuda" not in kinds:
        assert count == 0
    # the calls are coroutines; submit streams (an async generator, never a coroutine)
    for call in ("start", "abort", "close"):
        assert inspect.iscoroutinefunction(getattr(cls, call)), f"{backend}.{call}"
    submit = cls.submit  # type: ignore[attr-defined]
    assert inspect.isasyncgenfunction(submit) or not inspect.iscoroutinefunction(submit)


@pytest.mark.parametrize(("backend", "stage"), _cases())
def test_replica_implements_the_interface(backend: str, stage: str) -> None:
    cls = _class(backend)
    replica = _build(backend, stage)
    assert missing_members(replica, StageBackend) == []
    assert isinstance(replica, StageBackend)
    assert isinstance(replica.name, str) and replica.name == stage
    assert isinstance(replica.device, str)
    if replica.device == "auto":
        assert cls.keeps_auto
    else:
        assert replica.device.partition(":")[0] in cls.device_kinds
    assert isinstance(replica.restarts, int) and replica.restarts == 0
    # edges: edge types (engine/stages/edges.py), accepted by the graph as declared
    assert isinstance(replica.consumes, Edge) and isinstance(replica.emits, Edge)
    info = stage_info(stage, backend, replica)
    assert (info.consumes, info.emits) == (replica.consumes, replica.emits)
    if backend in ROLES and stage in testing.ROLES:  # a role's edges are the role's
        assert (replica.consumes, replica.emits) == testing.ROLES[stage]


@pytest.mark.parametrize(("backend", "stage"), _cases())
def test_declared_capabilities_are_consistent(backend: str, stage: str) -> None:
    replica = _build(backend, stage)
    runtime = getattr(replica, "runtime", None)  # the runtime a model backend holds, if any
    if isinstance(runtime, BatchingRuntime):  # batches: a max_batch, its slots, its steps
        assert isinstance(runtime.max_batch, int) and runtime.max_batch >= 1
        assert isinstance(replica, CapacitySource) and replica.capacity == runtime.max_batch
        assert isinstance(replica, StepSource) and isinstance(replica, BatchSizeSource)
        options = getattr(replica, "opts", None)
        if options is not None and hasattr(options, "max_batch"):
            assert runtime.max_batch == options.max_batch
    if isinstance(replica, StepSource):  # reports batch sizes: says how big they get
        assert isinstance(replica, CapacitySource)
    if isinstance(replica, CapacitySource):
        assert isinstance(replica.capacity, int) and replica.capacity >= 1
    if isinstance(replica, ChunkerSource):
        chunker = replica.make_chunker()
        if chunker is not None:
            assert callable(chunker.push) and callable(chunker.flush)
            assert chunker.flush() == []  # nothing pushed, nothing out
    if isinstance(replica, HealthSource):
        assert replica.health() is None  # not started: nothing is down yet
    if isinstance(replica, BatchSizeSource):
        assert replica.batch_size("no-such-request") == 0
    if isinstance(replica, PlacedBackend):
        devices = replica.start_devices()
        assert isinstance(devices, frozenset)
        assert all(d.startswith("cuda:") and d[5:].isdigit() for d in devices)
    if isinstance(replica, Voiced):
        voices = replica.voices()
        assert voices and all(isinstance(v, str) and v for v in voices)
    if isinstance(replica, EngineFiguresSource):
        assert isinstance(replica.engine_figures(), StageEngineFigures)
    # figure hooks: unset until the pool wires them, then kept
    for source, attr in ((StepSource, "on_step"), (QueueWaitSource, "on_wait")):
        if isinstance(replica, source):
            assert getattr(replica, attr) is None

            def hook(*_: object) -> None: ...

            setattr(replica, attr, hook)
            assert getattr(replica, attr) is hook
    if isinstance(replica, DecodeSource):
        assert replica.on_decode is None


class _NoRestarts:
    """A backend whose author forgot ``restarts`` and ``device``."""

    Options = testing.TestStageOptions
    device_kinds = frozenset({"cpu"})
    keeps_auto = False
    consumes = Edge.TEXT
    emits = Edge.TEXT

    def __init__(self, options: Any, name: str, *, device: str = "cpu", stage: Any = None):
        self.name = name

    @classmethod
    def cuda_device_count(cls) -> int:
        return 0

    async def start(self) -> None: ...

    async def submit(self, request: Any) -> Any:
        yield request

    async def abort(self, request_ids: Any) -> None: ...

    async def close(self) -> None: ...


class _NoOptions:
    """A backend class without ``Options`` or ``device_kinds``."""

    keeps_auto = False


def test_a_backend_missing_a_member_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    here = "tests.stages.test_stage_conformance"
    monkeypatch.setitem(backends.BACKENDS, "broken", f"{here}:_NoOptions")
    with pytest.raises(
        ConfigError, match=r"lacks Options, cuda_device_count, device_kinds"
    ) as info:
        backends.backend_class("broken", where="engine.stages.llm")
    assert "engine.stages.llm.backend: backend 'broken'" in str(info.value)
    # this very test file's conformance checks fail for such a backend
    with pytest.raises(ConfigError):
        test_backend_class_has_what_the_table_reads("broken")

    monkeypatch.setitem(backends.BACKENDS, "forgetful", f"{here}:_NoRestarts")
    config = engine_config(
        {"stages": {"llm": {"backend": "forgetful"}}, "routes": {"text": ["llm"]}}
    )
    with pytest.raises(ConfigError, match=r"engine.stages.llm.backend: .* lacks device, restarts"):
        build_graph(config)
    with pytest.raises(AssertionError):
        test_replica_implements_the_interface("forgetful", "llm")


def test_protocol_members_are_the_documented_ones() -> None:
    """The interface is what docs/engine.md's "Writing a stage backend" lists."""
    assert protocol_members(StageBackend) == [
        "abort",
        "close",
        "consumes",
        "device",
        "emits",
        "name",
        "restarts",
        "start",
        "submit",
    ]
    assert protocol_members(StageBackendClass) == [
        "Options",
        "__call__",
        "cuda_device_count",
        "device_kinds",
        "keeps_auto",
    ]
    text = DOCS.read_text()
    section = text[text.index("## Writing a stage backend") :]
    section = section[: section.index("\n## ", 5)]
    optional = [CapacitySource, ChunkerSource, HealthSource, BatchSizeSource, PlacedBackend]
    optional += [Voiced, StepSource, QueueWaitSource, DecodeSource, EngineFiguresSource]
    names = protocol_members(StageBackend) + protocol_members(StageBackendClass)[:1]
    names += [m for p in optional for m in protocol_members(p)] + [p.__name__ for p in optional]
    missing = [n for n in names if f"`{n}" not in section]
    assert missing == [], f"docs/engine.md does not document {missing}"


def test_a_started_test_backend_serves_through_the_interface_alone() -> None:
    """The interface is enough to drive a replica: start, submit, abort, close."""
    from engine.messages import LlmRequest, StageDone

    replica = _build("test", "llm")

    async def go() -> list[str]:
        await replica.start()
        try:
            kinds = []
            async for out in replica.submit(LlmRequest(request_id="r1", messages=())):
                kinds.append(type(out).__name__)
            await replica.abort(["r1"])
            return kinds
        finally:
            await replica.close()

    kinds = asyncio.run(go())
    assert kinds and kinds[-1] == StageDone.__name__
