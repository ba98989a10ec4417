"""tools/import_cycles.py: no import circle among the product's modules, also under
TYPE_CHECKING, with planted circles; those closed only inside functions are told apart."""

from __future__ import annotations

from pathlib import Path

from tools.import_cycles import check, cycles, describe, main

ROOT = Path(__file__).resolve().parents[2]


def _tree(tmp: Path, files: dict[str, str]) -> Path:
    for rel, code in {"engine/__init__.py": "", **files}.items():
        path = tmp / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(code)
    return tmp


def test_the_repository_keeps_the_rule() -> None:
    assert check(ROOT) == []
    assert main(["import_cycles", str(ROOT)]) == 0


def test_a_circle_under_type_checking_is_named_with_its_lines(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "engine/a.py": "from engine.b import B\n\nclass A: ...\n",
            "engine/b.py": (
                "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                "    from engine.a import A\n\nclass B: ...\n"
            ),
        },
    )
    assert check(root) == [
        "import circle: engine.a -> engine.b (engine/a.py:1) -> engine.a (engine/b.py:4)"
    ]
    assert main(["import_cycles", str(root)]) == 1


def test_a_longer_circle_through_relative_and_module_imports(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "engine/x/__init__.py": "",
            "engine/x/a.py": "from . import b\n",
            "engine/x/b.py": "import engine.x.c\n",
            "engine/x/c.py": "from ..x.a import thing\nthing = 1\n",
            "engine/x/d.py": "from engine.x import a\n",  # into the circle, not on it
        },
    )
    [circle] = cycles(root)
    assert describe(circle) == (
        "engine.x.a -> engine.x.b (engine/x/a.py:1) -> engine.x.c (engine/x/b.py:1)"
        " -> engine.x.a (engine/x/c.py:1)"
    )


def test_a_circle_closed_inside_a_function_is_reported_apart(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "engine/a.py": "from engine import b\n",
            "engine/b.py": "def later() -> None:\n    from engine import a\n",
        },
    )
    assert check(root) == [] and cycles(root) == []
    [circle] = cycles(root, deferred=True)
    assert [e.deferred for e in circle] == [False, True]


def test_a_package_that_imports_its_modules_is_no_circle(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "engine/x/__init__.py": "from engine.x.a import A\nfrom engine.x import b\n",
            "engine/x/a.py": "from engine.x.b import B\nclass A: ...\n",
            "engine/x/b.py": "class B: ...\n",
        },
    )
    assert cycles(root) == []
    # but a module that imports a name from its own package's __init__ is on a circle
    (root / "engine/x/b.py").write_text("from engine.x import A\nclass B: ...\n")
    assert {e.source for e in cycles(root)[0]} == {"engine.x", "engine.x.b"}  # the shortest


def test_make_lint_runs_the_check() -> None:
    lint = (ROOT / "Makefile").read_text().split("\nlint:", 1)[1].split("\n\n", 1)[0]
    assert "-m tools.import_cycles" in lint
