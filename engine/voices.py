"""Which voices the engine speaks in: asked of the speaking stage of its routes.

A backend that turns text into speech (or into codec frames a decoder turns into speech)
says which voices it has by implementing :class:`Voiced`; the first is its default. The
voices of a graph are those of the output stages of its ``voice`` and ``speech`` routes
(docs/engine.md); OpenAI's voice names are added as aliases of the default voice
(:class:`duplex_contract.voices.VoiceCatalog`). A graph with no speaking stage that says
(no audio route, or a backend that takes any name) has no catalog: voices are not checked.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from duplex_contract.voices import VoiceCatalog
from engine.config import EngineConfig
from engine.pipeline.graph import Graph, build_graph

#: the routes whose output is speech
SPEAKING_ROUTES = ("voice", "speech")


@runtime_checkable
class Voiced(Protocol):
    """A speaking stage's voices, its default first (never empty)."""

    def voices(self) -> tuple[str, ...]: ...


def catalog_of(graph: Graph) -> VoiceCatalog | None:
    """The voices of ``graph``'s speaking routes, or None if no stage of them says."""
    names: list[str] = []
    for route_name in SPEAKING_ROUTES:
        route = graph.routes.get(route_name)
        if route is None:
            continue
        for info in route.outputs:
            replica = graph.replicas[info.name][0]
            if isinstance(replica, Voiced):
                names += [v for v in replica.voices() if v not in names]
    return VoiceCatalog.with_openai_aliases(tuple(names)) if names else None


def voices_of(config: EngineConfig) -> VoiceCatalog | None:
    """:func:`catalog_of` the graph ``config`` builds (validated, nothing loaded)."""
    return catalog_of(build_graph(config))
