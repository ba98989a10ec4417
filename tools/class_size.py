"""No class over 400 lines or 25 methods, counted with its in-house bases, checked.

A class is one object however many files its bases are spread over: a chain of base
classes, one per file, is still one object a reader must hold in mind. So each class of
the product packages is measured together with every first-party class it inherits from
(transitively, each base once):

* lines: the ``class`` statement's lines (decorators excluded), summed over the class and
  its in-house bases;
* methods: the ``def`` / ``async def`` statements directly in those class bodies
  (properties and dunders count; functions nested in a method do not).

``typing.Protocol`` classes are interfaces, not bases with behaviour: a Protocol base is
not counted, and a Protocol class is not measured. Only classes at a module's top level are
measured. A base is found by its name in the class's module: a class defined there, or one
imported into it (``from m import C``, ``import m as x`` with ``x.C``, re-exports followed).

Over :data:`LINES` lines or :data:`METHODS` methods is an error; no class is exempt.
``python -m tools.class_size [ROOT] [--all]`` prints every class over the limit (``--all``:
also those near it); ``python -m tools.file_size`` runs the check.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

from tools.product import absolute, module_of, product_files

LINES = 400
METHODS = 25


@dataclass(frozen=True)
class ClassDef:
    """One top-level class as written: its own lines and methods, and its bases' names."""

    module: str
    name: str
    path: str  # relative to the root
    lines: int
    methods: int
    bases: tuple[str, ...]  # ``C`` or ``alias.C`` as written
    protocol: bool


@dataclass(frozen=True)
class Size:
    """A class measured with its in-house bases."""

    qualname: str  # module.Class
    path: str
    lines: int
    methods: int
    bases: tuple[str, ...] = ()  # the in-house bases counted, ``Class@path``

    @property
    def over(self) -> bool:
        return self.lines > LINES or self.methods > METHODS


@dataclass
class _Index:
    classes: dict[tuple[str, str], ClassDef] = field(default_factory=dict)
    #: module -> local name -> (module, name) it was imported as (``from m import n``)
    names: dict[str, dict[str, tuple[str, str]]] = field(default_factory=dict)
    #: module -> local name -> module it is bound to (``import m``, ``import m as x``)
    modules: dict[str, dict[str, str]] = field(default_factory=dict)


def _base_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Subscript):  # Generic[T], Base[T]
        node = node.value
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):  # module.Class, package.module.Class
        head = _base_name(node.value)
        return f"{head}.{node.attr}" if head else None
    return None


def _is_protocol(bases: tuple[str, ...]) -> bool:
    return any(b.rsplit(".", 1)[-1] == "Protocol" for b in bases)


def _index(root: Path) -> _Index:
    index = _Index()
    for path in product_files(root):
        module = module_of(path, root)
        tree = ast.parse(path.read_text(encoding="utf-8"))
        names = index.names.setdefault(module, {})
        modules = index.modules.setdefault(module, {})
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                source = absolute(node, module, path.name == "__init__.py")
                for alias in node.names:
                    names[alias.asname or alias.name] = (source, alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        modules[alias.asname] = alias.name
                    else:
                        top = alias.name.split(".")[0]
                        modules[top] = top
        for node in tree.body:
            if not isinstance(node, ast.ClassDef):
                continue
            bases = tuple(b for b in map(_base_name, node.bases) if b)
            end = node.end_lineno or node.lineno
            index.classes[(module, node.name)] = ClassDef(
                module=module,
                name=node.name,
                path=path.relative_to(root).as_posix(),
                lines=end - node.lineno + 1,
                methods=sum(
                    isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) for n in node.body
                ),
                bases=bases,
                protocol=_is_protocol(bases),
            )
    return index


def _resolve(index: _Index, module: str, name: str, depth: int = 0) -> ClassDef | None:
    """The first-party class ``name`` means in ``module`` (None: not first-party)."""
    if depth > 20:  # a re-export loop
        return None
    if "." in name:  # alias.Class, alias bound by ``import m [as alias]``
        head, _, rest = name.rpartition(".")
        first, _, more = head.partition(".")
        target = index.modules.get(module, {}).get(first)
        if target is None:
            imported = index.names.get(module, {}).get(first)  # ``from pkg import mod``
            if imported is None:
                return None
            target = f"{imported[0]}.{imported[1]}"
        return _resolve(index, f"{target}.{more}" if more else target, rest, depth + 1)
    found = index.classes.get((module, name))
    if found is not None:
        return found
    source = index.names.get(module, {}).get(name)
    if source is None or source[0] not in index.names:
        return None
    return _resolve(index, source[0], source[1], depth + 1)


def measure(root: Path) -> list[Size]:
    """Every product class that is not a Protocol, with its in-house bases, largest first."""
    index = _index(root)
    sizes: list[Size] = []
    for cls in index.classes.values():
        if cls.protocol:
            continue
        lines, methods, counted = 0, 0, []
        seen: set[tuple[str, str]] = set()
        stack = [cls]
        while stack:
            current = stack.pop()
            key = (current.module, current.name)
            if key in seen or (current.protocol and current is not cls):
                continue
            seen.add(key)
            lines += current.lines
            methods += current.methods
            if current is not cls:
                counted.append(f"{current.name}@{current.path}")
            for base in current.bases:
                found = _resolve(index, current.module, base)
                if found is not None:
                    stack.append(found)
        qualname = f"{cls.module}.{cls.name}"
        sizes.append(Size(qualname, cls.path, lines, methods, tuple(counted)))
    return sorted(sizes, key=lambda s: (-s.lines, -s.methods, s.qualname))


def describe(size: Size) -> str:
    bases = f" <- {' '.join(size.bases)}" if size.bases else ""
    return f"{size.lines:4d} lines {size.methods:3d} methods  {size.qualname}{bases}"


def oversize_classes(root: Path) -> list[str]:
    """One message per class over the limit."""
    return [
        f"{s.path}: class {s.qualname.rsplit('.', 1)[-1]}: {s.lines} lines, {s.methods} methods "
        f"with its in-house bases (limit {LINES} / {METHODS}): split it by job into objects "
        "it holds"
        for s in measure(root)
        if s.over
    ]


def main(argv: list[str]) -> int:
    args = [a for a in argv[1:] if not a.startswith("-")]
    root = Path(args[0]) if args else Path.cwd()
    sizes = measure(root)
    near = "--all" in argv
    for size in sizes:
        if size.over or (near and (size.lines > LINES * 5 // 8 or size.methods > METHODS * 3 // 4)):
            print(f"{'OVER ' if size.over else '     '}{describe(size)}")
    over = sum(s.over for s in sizes)
    print(f"{over} classes over {LINES} lines or {METHODS} methods")
    return 1 if oversize_classes(root) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
