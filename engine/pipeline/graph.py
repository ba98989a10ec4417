"""The stage graph: named stages, typed edges, and the routes work takes through them.

A backend declares what it consumes and emits (an :class:`Edge`); a route is an ordered list
of stage names whose edges must fit (``emits`` of one stage == ``consumes`` of the next).
Every route has the same shape, which the pipeline runs without knowing any stage by name::

    input stages      audio -> ... -> text    (audio->audio filters, then one audio->text)
    responder         text -> text            (at most one: the conversational LM)
    output stages     text -> ... -> audio    (text->audio, text->codec, codec->audio, ...)

Work enters a route at the first stage that consumes its input: audio at the first stage,
text at the first stage that consumes text (a typed message skips the ASR of a voice route).
Routes the server itself uses have fixed names and duties, checked at start-up:

========== ======================================== ======================================
route      used by                                  must
========== ======================================== ======================================
voice      sessions whose output includes audio;    have a responder; end in audio
           batch chat with audio output
text       sessions with text-only output;          have a responder; end in text
           batch chat
speech     ``/v1/audio/speech``                     start with text; end in audio; no
                                                    responder
transcribe ``/v1/audio/transcriptions``             start with audio; end in text; no
                                                    responder
========== ======================================== ======================================

A route that is missing is not an error at start-up; work that needs it fails with
``route_unavailable``. Everything here is checked before any model loads.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Final

from duplex_contract.errors import ConfigError, StageError
from engine.config import EngineConfig
from engine.gpu_memory import DeviceUse, check_gpu_memory, cuda_memory_gib
from engine.pipeline.stage_slots import check_scheduling, replica_capacity
from engine.stages.backends import build_replicas
from engine.stages.base import StageBackend, missing_members
from engine.stages.edges import Edge

ROUTE_DUTIES: Final[dict[str, str]] = {
    "voice": "sessions with audio output and batch chat with audio",
    "text": "sessions with text-only output and batch chat",
    "speech": "/v1/audio/speech",
    "transcribe": "/v1/audio/transcriptions",
}


@dataclass(frozen=True)
class StageInfo:
    name: str
    backend: str
    consumes: Edge
    emits: Edge

    @property
    def io(self) -> str:
        return f"{self.consumes.value} -> {self.emits.value}"


@dataclass(frozen=True)
class Route:
    """One validated route, split into its input stages, responder and output stages."""

    name: str
    stages: tuple[StageInfo, ...]
    inputs: tuple[StageInfo, ...]
    responder: StageInfo | None
    outputs: tuple[StageInfo, ...]

    @property
    def consumes(self) -> Edge:
        return self.stages[0].consumes

    @property
    def emits(self) -> Edge:
        return self.stages[-1].emits

    @property
    def accepts_text(self) -> bool:
        return any(s.consumes is Edge.TEXT for s in self.stages)

    def describe(self) -> str:
        return " -> ".join(f"{s.name}({s.io})" for s in self.stages)


@dataclass
class Graph:
    """Built replicas of every stage and the validated routes (nothing started yet)."""

    replicas: dict[str, list[StageBackend]]
    stages: dict[str, StageInfo]
    routes: dict[str, Route]
    #: what the stages take of each GPU (engine/gpu_memory.py), checked
    gpu_memory: tuple[DeviceUse, ...] = ()

    def route(self, name: str) -> Route:
        route = self.routes.get(name)
        if route is None:
            known = ", ".join(sorted(self.routes)) or "none"
            raise StageError(
                f"this server has no {name!r} route, needed for {ROUTE_DUTIES.get(name, name)} "
                f"(engine.routes defines: {known})",
                code="route_unavailable",
            )
        return route


def stage_info(name: str, backend: str, replica: StageBackend) -> StageInfo:
    missing = missing_members(replica, StageBackend)  # (injected replicas are checked too)
    if missing:
        raise ConfigError(
            f"engine.stages.{name}.backend: backend {backend!r} does not implement the stage "
            f"interface: it lacks {', '.join(missing)} (engine/stages/base.py)"
        )
    consumes, emits = replica.consumes, replica.emits
    if not isinstance(consumes, Edge) or not isinstance(emits, Edge):
        raise ConfigError(
            f"engine.stages.{name}.backend: backend {backend!r} does not declare the edge types "
            "it consumes and emits"
        )
    return StageInfo(name=name, backend=backend, consumes=consumes, emits=emits)


def _split(name: str, stages: Sequence[StageInfo]) -> Route:
    where = f"engine.routes.{name}"
    for prev, nxt in pairwise(stages):
        if prev.emits is not nxt.consumes:
            raise ConfigError(
                f"{where}: stage {nxt.name!r} (backend {nxt.backend}) consumes "
                f"{nxt.consumes.value} but the stage before it, {prev.name!r} (backend "
                f"{prev.backend}), emits {prev.emits.value}; "
                f"see engine.stages.{nxt.name}.backend"
            )
    i = 0
    while i < len(stages) and stages[i].consumes is Edge.AUDIO:
        i += 1
    inputs = tuple(stages[:i])
    for s in inputs[:-1]:
        if s.emits is not Edge.AUDIO:  # unreachable once edges fit; kept for clarity
            raise ConfigError(f"{where}: stage {s.name!r} must emit audio")
    rest = list(stages[i:])
    responder = None
    if rest and rest[0].consumes is Edge.TEXT and rest[0].emits is Edge.TEXT:
        responder = rest.pop(0)
    for s in rest:
        if s.consumes is Edge.TEXT and s.emits is Edge.TEXT:
            raise ConfigError(
                f"{where}: stage {s.name!r} (backend {s.backend}, text -> text) is a second "
                "responder; a route has at most one text -> text stage"
            )
        if s.consumes is Edge.AUDIO:  # pragma: no cover - excluded by the edge check above
            raise ConfigError(f"{where}: stage {s.name!r} consumes audio after the input stages")
    return Route(name, tuple(stages), inputs, responder, tuple(rest))


def _check_duty(route: Route) -> None:
    where = f"engine.routes.{route.name}"
    first, last = route.stages[0], route.stages[-1]
    if route.name in ("voice", "text"):
        if route.responder is None:
            raise ConfigError(
                f"{where}: needs a responder (a text -> text stage such as an LLM); "
                f"got {route.describe()}"
            )
        want = Edge.AUDIO if route.name == "voice" else Edge.TEXT
        if last.emits is not want:
            raise ConfigError(
                f"{where}: must end in {want.value}, but its last stage {last.name!r} "
                f"(backend {last.backend}) emits {last.emits.value}"
            )
    elif route.name == "speech":
        if first.consumes is not Edge.TEXT or route.responder is not None:
            raise ConfigError(
                f"{where}: must start with a stage that consumes text and has no responder; "
                f"got {route.describe()}"
            )
        if last.emits is not Edge.AUDIO:
            raise ConfigError(
                f"{where}: must end in audio, but its last stage {last.name!r} "
                f"(backend {last.backend}) emits {last.emits.value}"
            )
    elif route.name == "transcribe" and (
        first.consumes is not Edge.AUDIO
        or last.emits is not Edge.TEXT
        or route.responder is not None
        or route.outputs
    ):
        raise ConfigError(
            f"{where}: must turn audio into text with input stages only (audio -> text); "
            f"got {route.describe()}"
        )


def build_graph(
    config: EngineConfig,
    overrides: Mapping[str, Sequence[StageBackend]] | None = None,
    *,
    check_devices: bool = True,
) -> Graph:
    """Build every stage's replicas (no model is loaded) and validate the routes.

    ``overrides`` replaces the replicas of named stages (tests inject prepared backends).
    ``check_devices=False``: the placement is not checked against this machine's GPUs, and
    the memory shares per GPU only against each other (``duplex-server check
    --no-devices``: a GPU config on a machine without one).
    Raises :class:`ConfigError` naming the route, the stage and the field (also a scheduling
    reserve no stage slot is left beside, engine/orchestration/scheduling.py).
    """
    replicas: dict[str, list[StageBackend]] = {}
    infos: dict[str, StageInfo] = {}
    for name, stage in config.stages.items():
        if overrides is not None and name in overrides:
            built = list(overrides[name])
        else:
            built = build_replicas(name, stage, check_devices=check_devices)
        replicas[name] = built
        infos[name] = stage_info(name, stage.backend, built[0])
    check_scheduling(
        config.scheduling, {n: sum(replica_capacity(r) for r in rs) for n, rs in replicas.items()}
    )
    uses = check_gpu_memory(replicas, cuda_memory_gib if check_devices else lambda _: None)
    routes: dict[str, Route] = {}
    for rname, names in config.routes.items():
        route = _split(rname, [infos[n] for n in names])
        _check_duty(route)
        routes[rname] = route
    return Graph(replicas=replicas, stages=infos, routes=routes, gpu_memory=tuple(uses))


__all__ = ["ROUTE_DUTIES", "Edge", "Graph", "Route", "StageInfo", "build_graph"]
