"""The layering rule, checked: which first-party packages each layer may import.

    duplex_contract           imports no first-party package but itself
    audio_kit                 the audio kit, a leaf: itself and duplex_contract only
    duplex_server.protocol    the sans-I/O core: itself and duplex_contract only
    duplex_client             the SDK: itself, the protocol core and duplex_contract
    duplex_server (the rest)  itself, duplex_contract, audio_kit and the engine's public
                              API only: ENGINE_PUBLIC (engine.api.client, engine.config,
                              engine.api.remote, engine.api.remote_client,
                              engine.pipeline.graph, engine.voices); never a stage,
                              engine.messages, engine.orchestration.orchestrator or
                              engine.pipeline.pipeline
    engine/stages             anything but the control side: no control call
                              (duplex_contract.control), no session event (the members of
                              duplex_contract.session_events.SessionEvent), no control envelope
                              (engine.messages.ControlRequest, .SessionOutput), no session
                              machinery (engine.duplex), no orchestration module
                              (engine.orchestration) and no server or SDK module; of the
                              route machinery (engine.pipeline) only the chunkers a backend
                              may provide (STAGE_PIPELINE: engine.pipeline.chunkers)

The rooms inside the server and the engine keep their jobs apart:

    duplex_server.session     the session runtime: no transport (duplex_server.transports);
                              a transport drives a session, never the other way
    duplex_server.http        the batch routes: no transport and no session runtime
    duplex_server.ops         operations: no transport
    engine (all of it)        no server or SDK module
    engine.orchestration      no engine client (engine.api): the clients call it
    engine.pipeline           the route machinery: no orchestration module, no engine
                              client, no control plane (engine.duplex), no control call and
                              no session event: the orchestrator drives it
    engine.duplex             the control plane: no engine client and no stage backend

Every ``import`` and ``from ... import`` in a layer's files counts, wherever it is written
(inside a function or under ``TYPE_CHECKING`` too), and so does the ``__init__`` of every
package the import passes through (``duplex_server/__init__.py`` runs before the core).
A forbidden name is caught where it is imported by name (``from m import Name``).
Third-party and standard-library imports are not restricted. Exit status 1 and one line
per violation when the rule is broken: ``python -m tools.import_boundary [ROOT]``.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

from tools.product import FIRST_PARTY, absolute, module_of

#: the engine modules the server may import: its client API (engine.api.remote_client is the
#: front end's RemoteEngine, the AsyncEngine API over a socket; its frames, engine.api.remote_wire,
#: are not public)
ENGINE_PUBLIC = (
    "engine.api.client",
    "engine.config",
    "engine.api.remote",
    "engine.api.remote_client",
    "engine.pipeline.graph",
    "engine.voices",
)

#: the route machinery's modules a stage backend may import: the chunkers a backend may
#: provide (``make_chunker``) and those it builds them from
STAGE_PIPELINE = ("engine.pipeline.chunkers",)

#: the session events (duplex_contract.session_events.SessionEvent's members)
SESSION_EVENTS = tuple(
    f"duplex_contract.session_events.{name}"
    for name in (
        "SessionEvent",
        "UserTranscript",
        "ResponseStarted",
        "TextDelta",
        "FunctionCallDelta",
        "FunctionCallDone",
        "AudioChunk",
        "ResponseDone",
        "SessionLifecycle",
    )
)


@dataclass(frozen=True)
class Layer:
    name: str
    files: tuple[str, ...]  # globs relative to the repository root
    #: module prefixes this layer may import (None: any first-party module)
    allowed: tuple[str, ...] | None
    #: module (or ``module.Name``) prefixes this layer may not import, whatever ``allowed`` says
    forbidden: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()  # globs of files left to another layer
    #: module prefixes allowed inside a forbidden one (their parent packages too)
    excepted: tuple[str, ...] = ()


LAYERS = (
    Layer("contract", ("duplex_contract/**/*.py",), ("duplex_contract",)),
    Layer("audio kit", ("audio_kit/**/*.py",), ("audio_kit", "duplex_contract")),
    Layer(
        "protocol core",
        ("duplex_server/protocol/**/*.py", "duplex_server/__init__.py"),
        ("duplex_contract", "duplex_server.protocol"),
    ),
    Layer(
        "client SDK",
        ("clients/duplex_client/**/*.py",),
        ("duplex_client", "duplex_contract", "duplex_server.protocol"),
    ),
    Layer(
        "server",
        ("duplex_server/**/*.py",),
        ("duplex_server", "duplex_contract", "audio_kit", *ENGINE_PUBLIC),
        exclude=("duplex_server/protocol/**/*.py",),  # the core's rule is stricter
    ),
    Layer(
        "stage backends",
        ("engine/stages/**/*.py",),
        None,
        forbidden=(
            "duplex_contract.control",
            *SESSION_EVENTS,
            "engine.messages.ControlRequest",
            "engine.messages.SessionOutput",
            "engine.duplex",
            "engine.orchestration",
            "engine.pipeline",
            "duplex_server",
            "duplex_client",
        ),
        excepted=STAGE_PIPELINE,
    ),
    # the rooms
    Layer(
        "session runtime",
        ("duplex_server/session/**/*.py",),
        None,
        forbidden=("duplex_server.transports",),
    ),
    Layer(
        "batch routes",
        ("duplex_server/http/**/*.py",),
        None,
        forbidden=("duplex_server.transports", "duplex_server.session"),
    ),
    Layer(
        "operations", ("duplex_server/ops/**/*.py",), None, forbidden=("duplex_server.transports",)
    ),
    Layer(
        "engine",
        ("engine/**/*.py",),
        None,
        forbidden=("duplex_server", "duplex_client"),
        exclude=("engine/stages/**/*.py",),  # the stage backends' rule says it
    ),
    Layer("orchestration", ("engine/orchestration/**/*.py",), None, forbidden=("engine.api",)),
    Layer(
        "route machinery",
        ("engine/pipeline/**/*.py",),
        None,
        forbidden=(
            "engine.orchestration",
            "engine.api",
            "engine.duplex",
            "duplex_contract.control",
            *SESSION_EVENTS,
        ),
    ),
    Layer(
        "control plane",
        ("engine/duplex/**/*.py",),
        None,
        forbidden=("engine.api", "engine.stages"),
    ),
)


def imports_of(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """``(line, absolute module)`` of every import in ``source``."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = absolute(node, module, is_package)
            out.append((node.lineno, base))
            # ``from pkg import mod`` imports ``pkg.mod`` when it is a module
            out += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return out


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _allowed(name: str, layer: Layer) -> bool:
    if name.split(".")[0] not in FIRST_PARTY:
        return True
    excepted = any(_under(name, e) or e.startswith(name + ".") for e in layer.excepted)
    if any(_under(name, f) for f in layer.forbidden) and not excepted:
        return False  # (an excepted module of a forbidden room, or its package, is not)
    if layer.allowed is None:
        return True
    # a parent package of an allowed one is fine (its __init__ is checked on its own)
    return any(_under(name, a) or a.startswith(name + ".") for a in layer.allowed)


def check(root: Path) -> list[str]:
    errors: list[str] = []
    parsed: dict[Path, list[tuple[int, str]]] = {}  # a file is in several layers: parse once
    for layer in LAYERS:
        excluded = {p for pattern in layer.exclude for p in root.glob(pattern)}
        for pattern in layer.files:
            for path in sorted(set(root.glob(pattern)) - excluded):
                module = module_of(path, root)
                is_package = path.name == "__init__.py"
                seen: set[int] = set()
                if path not in parsed:
                    parsed[path] = imports_of(path.read_text(), module, is_package)
                for line, name in parsed[path]:
                    if line not in seen and not _allowed(name, layer):
                        seen.add(line)  # one report per import statement
                        rel = path.relative_to(root)
                        errors.append(f"{rel}:{line}: the {layer.name} imports {name}")
    return errors


def main(argv: list[str]) -> int:
    root = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parent.parent
    errors = check(root)
    for err in errors:
        print(err, file=sys.stderr)
    if errors:
        print(f"import boundary: {len(errors)} violation(s)", file=sys.stderr)
        return 1
    print("import boundary: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
