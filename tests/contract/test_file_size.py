"""tools/file_size.py: the 500-line rule for product files, the 400-line / 25-method rule for
classes with their in-house bases (tools/class_size.py), and that make lint runs both."""

from __future__ import annotations

from pathlib import Path

from tools.class_size import LINES, measure, oversize_classes
from tools.file_size import EXEMPT, LIMIT, main, oversize

ROOT = Path(__file__).resolve().parents[2]


def test_the_product_is_within_the_limit() -> None:
    assert oversize(ROOT) == []


def test_a_long_file_is_named_and_fails(tmp_path: Path) -> None:
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "short.py").write_text("x = 1\n" * LIMIT)
    (tmp_path / "engine" / "long.py").write_text("x = 1\n" * (LIMIT + 1))
    errors = oversize(tmp_path)
    assert errors == [f"engine/long.py: {LIMIT + 1} lines (limit {LIMIT}): split it by job"]
    assert main(["file_size", str(tmp_path)]) == 1


def test_exempt_files_exist_and_say_why() -> None:
    for rel, why in EXEMPT.items():
        assert (ROOT / rel).is_file() and why


def test_make_lint_runs_it() -> None:
    lint = (ROOT / "Makefile").read_text().split("\nlint:", 1)[1].split("\n\n", 1)[0]
    assert "-m tools.file_size" in lint


# ---------------------------------------------------------------- classes with their bases


def _write(root: Path, rel: str, code: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(code)


def _methods(n: int, prefix: str = "m") -> str:
    return "".join(f"    def {prefix}{i}(self) -> None: ...\n" for i in range(n))


def test_the_product_classes_are_within_the_limit() -> None:
    assert oversize_classes(ROOT) == []


def test_a_class_over_by_lines_is_named(tmp_path: Path) -> None:
    body = "    x = 1\n" * LINES  # the class statement makes it LINES + 1
    _write(tmp_path, "engine/big.py", f"class Big:\n{body}\n\nclass Small:\n    y = 2\n")
    errors = oversize_classes(tmp_path)
    assert len(errors) == 1, errors
    assert errors[0].startswith(f"engine/big.py: class Big: {LINES + 1} lines, 0 methods")
    assert main(["file_size", str(tmp_path)]) == 1


def test_methods_of_a_base_in_another_module_count(tmp_path: Path) -> None:
    # 20 methods in the base, 6 in the class: 26 together, though each file is small
    _write(tmp_path, "engine/__init__.py", "")
    _write(tmp_path, "engine/base.py", f"class Base:\n{_methods(20, 'b')}")
    _write(
        tmp_path,
        "engine/child.py",
        f"from engine.base import Base\n\n\nclass Child(Base):\n{_methods(6)}",
    )
    sizes = {s.qualname: s for s in measure(tmp_path)}
    assert (sizes["engine.base.Base"].methods, sizes["engine.child.Child"].methods) == (20, 26)
    assert sizes["engine.child.Child"].bases == ("Base@engine/base.py",)
    errors = oversize_classes(tmp_path)
    assert len(errors) == 1 and "engine/child.py: class Child:" in errors[0]
    assert "26 methods with its in-house bases" in errors[0]


def test_a_base_reached_through_a_module_alias_or_a_relative_import_counts(
    tmp_path: Path,
) -> None:
    _write(tmp_path, "engine/__init__.py", "")
    _write(tmp_path, "engine/base.py", f"class Base:\n{_methods(20, 'b')}")
    _write(
        tmp_path, "engine/a.py", f"from engine import base as b\n\nclass A(b.Base):\n{_methods(6)}"
    )
    _write(tmp_path, "engine/c.py", f"from .base import Base\n\nclass C(Base[int]):\n{_methods(6)}")
    over = {s.qualname for s in measure(tmp_path) if s.over}
    assert over == {"engine.a.A", "engine.c.C"}


def test_a_protocol_base_is_not_counted(tmp_path: Path) -> None:
    _write(tmp_path, "engine/__init__.py", "")
    _write(
        tmp_path,
        "engine/port.py",
        f"from typing import Protocol\n\n\nclass Port(Protocol):\n{_methods(30, 'p')}",
    )
    _write(
        tmp_path,
        "engine/impl.py",
        f"from engine.port import Port\n\n\nclass Impl(Port):\n{_methods(6)}",
    )
    sizes = {s.qualname: s for s in measure(tmp_path)}
    assert "engine.port.Port" not in sizes  # an interface is not measured
    assert sizes["engine.impl.Impl"].methods == 6
    assert oversize_classes(tmp_path) == []
