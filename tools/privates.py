"""No private name crosses a module or an object in product code, checked.

A name that starts with one underscore is its module's or its object's own business: the
owner may change it without looking further. Product code (:mod:`tools.product`; tests
and bench may reach in) breaks that in three ways, each reported with its file and line:

* **import**: ``from m import _x`` (``_x`` a private function, class, constant or module);
* **module**: ``m._x`` where ``m`` is a first-party module bound by an import
  (``import engine.spans``, ``from engine import spans``);
* **object**: ``obj._x`` where ``obj`` is not ``self`` or ``cls`` (a reach into another
  object's private attributes), ``obj`` any expression: a parameter, a local, ``self._a._x``.

What is allowed, precisely:

* dunders (``__x__``) and enum's sunders (``_x_``) are not private; nor are the namedtuple
  methods spelled with an underscore (:data:`PUBLIC_UNDERSCORE`: ``_replace``, ``_asdict``...);
* ``self._x``, ``cls._x``, ``super()._x`` and ``type(self)._x``: the object's own;
* inside a class body, ``other._x`` where the class itself defines ``_x`` (a method or class
  attribute in its body, or an attribute it assigns as ``self._x``): another instance of
  the same class (``__eq__``, a merge, a classmethod that builds one and fills it in). A
  function outside the class that reaches into it is not allowed, in the same module or not;
* ``m._x`` on a module that is not first-party (``os._exit``, ``sys._getframe``): the
  standard library's and third parties' own conventions.

Every violation is an error; no file is exempt.
``python -m tools.privates [ROOT] [--list]`` (``--list``: also the count per file).
"""

from __future__ import annotations

import ast
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from tools.product import absolute, first_party, module_of, product_files

#: public API of the standard library that is spelled with a leading underscore
PUBLIC_UNDERSCORE = frozenset({"_replace", "_asdict", "_fields", "_field_defaults", "_make"})
#: names that mean the object itself
OWN = frozenset({"self", "cls"})


@dataclass(frozen=True, order=True)
class Violation:
    path: str
    line: int
    kind: str  # import | module | object
    text: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.kind}: {self.text}"


def is_private(name: str) -> bool:
    """``_x`` or ``__x``; not a dunder, a sunder or a public underscore name."""
    if not name.startswith("_") or name in PUBLIC_UNDERSCORE:
        return False
    if name.startswith("__") and name.endswith("__"):
        return False
    return not (len(name) > 2 and name.endswith("_") and not name.startswith("__"))


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return f"{head}.{node.attr}" if head else None
    return None


def _own_privates(cls: ast.ClassDef) -> frozenset[str]:
    """The private names a class defines: in its body, or assigned as ``self._x``."""
    names: set[str] = set()
    for node in cls.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    for sub in ast.walk(cls):
        if (
            isinstance(sub, ast.Attribute)
            and isinstance(sub.ctx, ast.Store)
            and isinstance(sub.value, ast.Name)
            and sub.value.id in OWN
        ):
            names.add(sub.attr)
    return frozenset(n for n in names if is_private(n))


def _is_own(node: ast.expr) -> bool:
    """``self``, ``cls``, ``super()``, ``type(self)``."""
    if isinstance(node, ast.Name):
        return node.id in OWN
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        if node.func.id == "super":
            return True
        return node.func.id == "type" and len(node.args) == 1 and _is_own(node.args[0])
    return False


class _Scanner(ast.NodeVisitor):
    def __init__(self, path: str, module: str, is_package: bool, modules: set[str]) -> None:
        self.path, self.module, self.is_package = path, module, is_package
        self.modules = modules  # every first-party module of the tree
        self.bound: dict[str, str] = {}  # local name -> module it is bound to
        self.classes: list[frozenset[str]] = []  # private names of the enclosing classes
        self.found: list[Violation] = []

    def _add(self, node: ast.AST, kind: str, text: str) -> None:
        self.found.append(Violation(self.path, getattr(node, "lineno", 0), kind, text))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            for part in alias.name.split(".")[1:]:
                if is_private(part):
                    self._add(node, "import", f"import {alias.name}")
            if alias.asname:
                self.bound[alias.asname] = alias.name
            else:
                top = alias.name.split(".")[0]
                self.bound[top] = top

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        source = absolute(node, self.module, self.is_package)
        for alias in node.names:
            if is_private(alias.name):
                self._add(node, "import", f"from {source} import {alias.name}")
            if f"{source}.{alias.name}" in self.modules or not first_party(source):
                self.bound[alias.asname or alias.name] = f"{source}.{alias.name}"

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.classes.append(_own_privates(node))
        self.generic_visit(node)
        self.classes.pop()

    def visit_Attribute(self, node: ast.Attribute) -> None:
        self.generic_visit(node)
        if not is_private(node.attr) or _is_own(node.value):
            return
        dotted = _dotted(node.value)
        if dotted is not None:
            head, _, rest = dotted.partition(".")
            bound = self.bound.get(head)
            if bound is not None and (target := f"{bound}.{rest}" if rest else bound):
                if not first_party(target):
                    return  # os._exit, sys._getframe: not ours to judge
                if target in self.modules:
                    self._add(node, "module", f"{dotted}.{node.attr} (module {target})")
                    return
        if self.classes and node.attr in self.classes[-1]:
            return  # another instance of the class that defines it
        self._add(node, "object", f"{ast.unparse(node.value)}.{node.attr}")


def scan(root: Path) -> list[Violation]:
    """Every private name that crosses a module or an object in the product, in file order."""
    files = product_files(root)
    modules = {module_of(p, root) for p in files}
    found: list[Violation] = []
    for path in files:
        module = module_of(path, root)
        rel = path.relative_to(root).as_posix()
        scanner = _Scanner(rel, module, path.name == "__init__.py", modules)
        scanner.visit(ast.parse(path.read_text(encoding="utf-8")))
        found += sorted(scanner.found)
    return found


def check(root: Path) -> list[str]:
    """One message per violation."""
    return [
        f"{v}: a private name crosses a module or an object (make it public, or move the "
        "code to its owner)"
        for v in scan(root)
    ]


def main(argv: list[str]) -> int:
    args = [a for a in argv[1:] if not a.startswith("-")]
    root = Path(args[0]) if args else Path.cwd()
    errors = check(root)
    if "--list" in argv:
        for path, count in Counter(v.path for v in scan(root)).most_common():
            print(f"{count:4d}  {path}")
    for line in errors:
        print(line, file=sys.stderr)
    if errors:
        print(f"privates: {len(errors)} problem(s)", file=sys.stderr)
        return 1
    print("privates: ok (none crosses a module or an object)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
