"""No import circle among the product's modules, also under ``TYPE_CHECKING``, checked.

Two modules that import each other are one unit a reader cannot take apart, and mypy,
Python and a newcomer each resolve such a circle differently. The graph this checks:

* nodes: the first-party modules (audio_kit, duplex_contract, duplex_server, engine,
  clients/duplex_client), a package by its ``__init__``;
* edges: every import that runs when the module is imported, or that a type checker
  follows: the module body's, including those under ``if TYPE_CHECKING:``, in ``try``
  blocks and in class bodies; not those inside a function (a deferred import, reported
  apart with ``--deferred``). ``import a.b`` and ``from a import b`` (``b`` a module) go to
  ``a.b``; ``from a.b import Name`` goes to ``a.b`` (the package, when ``a.b`` is one). The
  parent packages an import passes through are not edges of their own: Python runs their
  ``__init__`` first, whatever the import, so an ``__init__`` that imports its submodules
  would otherwise be on a circle with each of them.

A circle is a strongly connected component of more than one module (or a module that
imports itself). Each is reported as one circle through it, edge by edge, with the line of
each import; every circle is an error, none is exempt.
``python -m tools.import_cycles [ROOT] [--deferred]`` (``--deferred``: also print the
circles that only function-level imports close; those are not errors).
"""

from __future__ import annotations

import ast
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from tools.product import absolute, module_of, product_files


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    path: str  # the importing file, relative to the root
    line: int
    deferred: bool  # inside a function


def _imports(tree: ast.Module) -> list[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement with whether it is inside a function."""
    out: list[tuple[ast.Import | ast.ImportFrom, bool]] = []
    stack: list[tuple[ast.AST, bool]] = [(tree, False)]
    while stack:
        node, deferred = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import | ast.ImportFrom):
                out.append((child, deferred))
            inner = deferred or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            stack.append((child, inner or isinstance(child, ast.Lambda)))
    return sorted(out, key=lambda item: item[0].lineno)


def edges_of(root: Path) -> tuple[set[str], list[Edge]]:
    """The product's modules and the first-party imports between them."""
    modules = {module_of(p, root): p for p in product_files(root)}
    edges: list[Edge] = []
    for module, path in modules.items():
        rel = path.relative_to(root).as_posix()
        is_package = path.name == "__init__.py"
        for node, deferred in _imports(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = absolute(node, module, is_package)
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in modules else base)
            for target in dict.fromkeys(targets):
                while target and target not in modules:  # ``import a.b.Name``-like spellings
                    target = target.rpartition(".")[0]
                if target:
                    edges.append(Edge(module, target, rel, node.lineno, deferred))
    return set(modules), edges


def _components(nodes: set[str], edges: list[Edge]) -> list[list[str]]:
    """Tarjan's strongly connected components that are circles, each sorted."""
    succ: dict[str, list[str]] = {n: [] for n in nodes}
    for e in edges:
        succ[e.source].append(e.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for start in sorted(nodes):
        if start in index:
            continue
        work: list[tuple[str, int]] = [(start, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = counter
                counter += 1
                stack.append(node)
                on_stack.add(node)
            children = succ[node]
            if i < len(children):
                work.append((node, i + 1))
                child = children[i]
                if child not in index:
                    work.append((child, 0))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            if work:  # propagate to the parent
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                members: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    members.append(member)
                    if member == node:
                        break
                if len(members) > 1 or node in succ[node]:
                    out.append(sorted(members))
    return sorted(out)


def _circle(members: list[str], edges: list[Edge]) -> list[Edge]:
    """One shortest circle through the first member, inside the component."""
    inside = set(members)
    first: dict[tuple[str, str], Edge] = {}
    for e in edges:
        if e.source in inside and e.target in inside:
            first.setdefault((e.source, e.target), e)
    start = members[0]
    came: dict[str, Edge] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for (source, target), edge in first.items():
            if source != node:
                continue
            if target == start:
                path = [edge]
                while path[0].source != start:
                    path.insert(0, came[path[0].source])
                return path
            if target not in came:
                came[target] = edge
                queue.append(target)
    return []


def describe(circle: list[Edge]) -> str:
    hops = " -> ".join(f"{e.target} ({e.path}:{e.line})" for e in circle)
    return f"{circle[0].source} -> {hops}"


def cycles(root: Path, *, deferred: bool = False) -> list[list[Edge]]:
    """One circle per strongly connected component (``deferred``: with function-level
    imports too)."""
    nodes, edges = edges_of(root)
    used = [e for e in edges if deferred or not e.deferred]
    return [_circle(members, used) for members in _components(nodes, used)]


def check(root: Path) -> list[str]:
    """One message per circle closed at module level (``TYPE_CHECKING`` included)."""
    nodes, edges = edges_of(root)
    module_level = [e for e in edges if not e.deferred]
    return [
        f"import circle: {describe(_circle(members, module_level))}"
        for members in _components(nodes, module_level)
    ]


def main(argv: list[str]) -> int:
    args = [a for a in argv[1:] if not a.startswith("-")]
    root = Path(args[0]) if args else Path.cwd()
    if "--deferred" in argv:
        nodes, edges = edges_of(root)
        module_level = {
            frozenset(c) for c in _components(nodes, [e for e in edges if not e.deferred])
        }
        for members in _components(nodes, edges):
            if frozenset(members) not in module_level:
                print(f"closed by a function-level import: {describe(_circle(members, edges))}")
    errors = check(root)
    for line in errors:
        print(line, file=sys.stderr)
    if errors:
        print(f"import cycles: {len(errors)} problem(s)", file=sys.stderr)
        return 1
    print("import cycles: ok (none, also under TYPE_CHECKING)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
