"""tools/privates.py: no private name crosses a module or an object in product code, with
planted violations of each kind and the cases the rule allows."""

from __future__ import annotations

from pathlib import Path

from tools.privates import check, is_private, main, scan

ROOT = Path(__file__).resolve().parents[2]


def _tree(tmp: Path, files: dict[str, str]) -> Path:
    for rel, code in files.items():
        path = tmp / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(code)
    return tmp


LIB = """
class Box:
    def __init__(self) -> None:
        self._inner = 1

    def _peek(self) -> int:
        return self._inner

_SECRET = 1
"""


def test_the_repository_keeps_the_rule() -> None:
    assert check(ROOT) == []
    assert main(["privates", str(ROOT)]) == 0


def test_which_names_are_private() -> None:
    assert is_private("_x") and is_private("__mangled") and is_private("_END")
    for public in ("x", "__init__", "__dict__", "_value_", "_missing_", "_replace", "_asdict"):
        assert not is_private(public), public


def test_a_private_import_is_named(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "engine/__init__.py": "",
            "engine/lib.py": LIB,
            "engine/user.py": "from engine.lib import Box, _SECRET\nfrom .lib import _SECRET as S",
        },
    )
    found = [str(v) for v in scan(root)]
    assert found == [
        "engine/user.py:1: import: from engine.lib import _SECRET",
        "engine/user.py:2: import: from engine.lib import _SECRET",
    ]


def test_a_module_private_reached_through_the_module_is_named(tmp_path: Path) -> None:
    user = "import engine.lib\nfrom engine import lib\n\nA = engine.lib._SECRET\nB = lib._SECRET\n"
    root = _tree(tmp_path, {"engine/__init__.py": "", "engine/lib.py": LIB, "engine/user.py": user})
    found = [str(v) for v in scan(root)]
    assert found == [
        "engine/user.py:4: module: engine.lib._SECRET (module engine.lib)",
        "engine/user.py:5: module: lib._SECRET (module engine.lib)",
    ]


def test_a_reach_into_another_objects_privates_is_named(tmp_path: Path) -> None:
    user = """
from engine.lib import Box


def peek(box: Box) -> int:  # a function outside the class, same module or not
    return box._inner


class Holder:
    def __init__(self) -> None:
        self._box = Box()

    def peek(self) -> int:
        return self._box._peek()
"""
    root = _tree(tmp_path, {"engine/__init__.py": "", "engine/lib.py": LIB, "engine/user.py": user})
    found = [str(v) for v in scan(root)]
    assert found == [
        "engine/user.py:6: object: box._inner",
        "engine/user.py:14: object: self._box._peek",
    ]
    lib_too = LIB + "\n\ndef peek(box: Box) -> int:\n    return box._inner\n"
    (root / "engine/lib.py").write_text(lib_too)
    assert "engine/lib.py:13: object: box._inner" in [str(v) for v in scan(root)]


def test_what_the_rule_allows(tmp_path: Path) -> None:
    fine = """
import enum
import os
import sys
from collections import namedtuple

Pair = namedtuple("Pair", "a b")


class Color(enum.Enum):
    RED = 1

    @classmethod
    def _missing_(cls, value: object) -> "Color":
        return cls.RED


class Base:
    def _hook(self) -> None: ...


class Counter(Base):
    _shared = 0

    def __init__(self) -> None:
        self._n = 0

    def __eq__(self, other: object) -> bool:  # another instance of the same class
        return isinstance(other, Counter) and other._n == self._n

    @classmethod
    def merged(cls, a: "Counter", b: "Counter") -> "Counter":
        out = cls()
        out._n = a._n + b._n
        cls._shared += 1
        return out

    def _hook(self) -> None:
        super()._hook()
        type(self)._shared += 1


def main() -> None:
    print(Pair(1, 2)._replace(a=3)._asdict(), Color.RED._value_, Counter().__dict__)
    sys._getframe()
    os._exit(0)
"""
    root = _tree(tmp_path, {"engine/__init__.py": "", "engine/fine.py": fine})
    assert scan(root) == []


def test_tests_and_bench_may_reach_in(tmp_path: Path) -> None:
    reach = "from engine.lib import _SECRET\n"
    root = _tree(
        tmp_path,
        {"engine/lib.py": LIB, "tests/test_x.py": reach, "bench/b.py": reach, "tools/t.py": reach},
    )
    assert scan(root) == []


def test_every_violation_fails_the_check(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {"engine/lib.py": LIB, "engine/user.py": "from engine.lib import _SECRET, _X\n"},
    )
    assert check(root) == [
        f"engine/user.py:1: import: from engine.lib import {name}: a private name crosses a "
        "module or an object (make it public, or move the code to its owner)"
        for name in ("_SECRET", "_X")
    ]
    assert main(["privates", str(root)]) == 1


def test_make_lint_runs_the_check() -> None:
    lint = (ROOT / "Makefile").read_text().split("\nlint:", 1)[1].split("\n\n", 1)[0]
    assert "-m tools.privates" in lint
